"""Is the daemon alive? Judged from the header words the token reader reads each poll.

    header snapshot (status, heartbeat, epoch) -> HealthMonitor.observe -> BackendHealth

Healthy means backend_status == READY and the heartbeat counter advanced within
`window_s`. Ages are measured on this process's clock from the moment a change
was seen, so the daemon's clock never has to agree with ours; on one machine
(`shares_clock`) the first observation uses backend_heartbeat_ns directly, so a
daemon that died before this frontend started is recognised at once.
"""
from __future__ import annotations

import dataclasses
import time

from shared_layout import BackendStatus


@dataclasses.dataclass(frozen=True)
class BackendHealth:
    status: str                    # BackendStatus name, or "DOWN" when no ring is attached
    healthy: bool
    heartbeat_age_s: float | None  # None: never observed
    backend_epoch: int
    message: str = ""              # why not healthy


class HealthMonitor:
    def __init__(self, window_s: float, shares_clock: bool):
        self.window_s = window_s
        self.shares_clock = shares_clock
        self.status = BackendStatus.DOWN
        self.backend_epoch = 0
        self.backend_pid = 0
        self.model_max_len = 0
        self.vocab_size = 0
        self.kv_blocks_total = 0           # the daemon's KV pool (0: not reported)
        self.kv_blocks_free = 0
        self.prefix_caching = False        # the daemon shares cached prefix blocks; counters below
        self.kv_blocks_cached = 0
        self.prefix_counters = {"hit_tokens": 0, "miss_tokens": 0, "hit_blocks": 0, "miss_blocks": 0}
        self._beat: int | None = None
        self._beat_seen_s = 0.0

    def observe(self, header, now_s: float | None = None) -> None:
        """Take the header words of one snapshot (a numpy record of HEADER_DTYPE)."""
        now_s = time.monotonic() if now_s is None else now_s
        beat, epoch = int(header["backend_heartbeat"]), int(header["backend_epoch"])
        if self._beat is None:
            self._beat_seen_s = now_s
            if self.shares_clock and int(header["backend_heartbeat_ns"]):
                age_s = max(0.0, now_s - int(header["backend_heartbeat_ns"]) / 1e9)
                self._beat_seen_s = now_s - age_s
        elif beat != self._beat or epoch != self.backend_epoch:
            self._beat_seen_s = now_s
        self._beat = beat
        self.backend_epoch = epoch
        try:
            self.status = BackendStatus(int(header["backend_status"]))
        except ValueError:
            self.status = BackendStatus.DOWN
        self.backend_pid = int(header["backend_pid"])
        self.model_max_len = int(header["model_max_len"])
        self.vocab_size = int(header["model_vocab_size"])
        self.kv_blocks_total = int(header["kv_blocks_total"])
        self.kv_blocks_free = int(header["kv_blocks_free"])
        self.prefix_caching = bool(int(header["prefix_caching"]))
        self.kv_blocks_cached = int(header["kv_blocks_cached"])
        self.prefix_counters = {k: int(header["prefix_" + k]) for k in self.prefix_counters}

    def heartbeat_age_s(self, now_s: float | None = None) -> float | None:
        if self._beat is None:
            return None
        return max(0.0, (time.monotonic() if now_s is None else now_s) - self._beat_seen_s)

    def lost(self, now_s: float | None = None) -> bool:
        """The daemon stopped beating for longer than the window (crashed, killed, hung)."""
        age = self.heartbeat_age_s(now_s)
        return age is not None and age > self.window_s

    def health(self, now_s: float | None = None) -> BackendHealth:
        age = self.heartbeat_age_s(now_s)
        msg = ""
        if age is None:
            msg = "backend not observed yet"
        elif age > self.window_s:
            pid = f" (pid {self.backend_pid})" if self.backend_pid else ""
            msg = f"backend lost: no heartbeat for {age:.1f} s{pid}"
        elif self.status != BackendStatus.READY:
            msg = f"backend {self.status.name.lower()}"
        return BackendHealth(self.status.name, not msg, age, self.backend_epoch, msg)
