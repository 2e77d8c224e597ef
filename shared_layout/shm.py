"""The ring as a POSIX shared-memory file (/dev/shm/NAME), mapped with mmap.

The daemon creates it (mode 0600: only the service user may map it) and
formats it; the frontend and tests attach. Plain files under /dev/shm rather
than multiprocessing.shared_memory, whose resource tracker unlinks segments
when an attaching process exits.
"""
from __future__ import annotations

import mmap
import os
import re

SHM_DIR = "/dev/shm"
DEFAULT_RING_NAME = "blink-ring"
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def shm_path(name: str) -> str:
    if not _NAME.match(name) or name in (".", ".."):
        raise ValueError(f"invalid ring name {name!r}: use letters, digits, '.', '_' or '-'")
    return os.path.join(SHM_DIR, name)


class ShmRegion:
    """A mapped shared-memory file; `buf` is the writable mmap."""

    def __init__(self, name: str, size: int, fd: int):
        self.name = name
        self.size = size
        self.path = shm_path(name)
        self.buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)

    @classmethod
    def create(cls, name: str, size: int, mode: int = 0o600, replace: bool = True) -> "ShmRegion":
        """Create (or replace) the file at `size` bytes, zero-filled."""
        path = shm_path(name)
        if replace:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.fchmod(fd, mode)  # umask may have narrowed or the caller may want 0600 exactly
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(name, size, fd)

    @classmethod
    def open(cls, name: str) -> "ShmRegion":
        """Map an existing file whole; FileNotFoundError when no daemon made it."""
        fd = os.open(shm_path(name), os.O_RDWR)
        size = os.fstat(fd).st_size
        if size == 0:
            os.close(fd)
            raise FileNotFoundError(f"ring {name!r} exists but is empty (daemon still starting?)")
        return cls(name, size, fd)

    def close(self) -> None:
        try:
            self.buf.close()
        except BufferError:
            pass  # numpy views still alive; the mapping goes with the process

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    @staticmethod
    def exists(name: str) -> bool:
        return os.path.exists(shm_path(name))
