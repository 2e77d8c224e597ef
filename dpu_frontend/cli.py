"""`blink`: one command line for every part of the system.

Each subcommand lives in the package that owns it and is imported only when
invoked, so a DPU install without torch can still run `blink frontend`:

    blink serve       -> dpu_frontend.serve      (daemon + frontend as two child processes)
    blink frontend    -> dpu_frontend.server_cli (OpenAI HTTP/SSE over the ring)
    blink gpu-daemon  -> gpu_backend.cli         (model, KV cache, executor loop)
    blink run-batch   -> dpu_frontend.batch.cli  (an OpenAI batch file through a server)
    blink bench       -> bench.cli               (load generator and interference runner)

A subcommand module provides `add_arguments(parser)` and `run(args) -> int`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "serve": ("dpu_frontend.serve", "run the GPU daemon and the frontend together (the quick start)"),
    "frontend": ("dpu_frontend.server_cli", "run the OpenAI-compatible HTTP/SSE frontend over a ring"),
    "gpu-daemon": ("gpu_backend.cli", "run the daemon: load the model and serve the ring"),
    "run-batch": ("dpu_frontend.batch.cli", "run an OpenAI batch file (.jsonl) through blink serve or --url"),
    "bench": ("bench.cli", "drive an OpenAI-compatible endpoint, with or without CPU interference"),
}


def _load(name: str):
    module, _ = SUBCOMMANDS[name]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (e.name == module or module.startswith(e.name + ".")):
            return None  # not built yet
        raise


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="blink", description="BLINK-py: LLM serving with the host CPU off the token path")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = _load_quietly(name)
        if mod is not None:
            mod.add_arguments(p)
        p.set_defaults(_command=name)
    return ap


def _load_quietly(name: str):
    """Import a subcommand for its arguments; a missing optional dependency is reported at run time."""
    try:
        return _load(name)
    except ImportError:
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    args = ap.parse_args(argv)
    if not getattr(args, "command", None):
        ap.print_help()
        return 0
    try:
        mod = _load(args.command)
    except ImportError as e:
        print(f"blink {args.command}: missing dependency {e.name or e} "
              f"(install the matching extra, e.g. pip install 'blink-py[gpu]')", file=sys.stderr)
        return 2
    if mod is None:
        print(f"blink {args.command}: not built yet in this version", file=sys.stderr)
        return 2
    try:
        return int(mod.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
