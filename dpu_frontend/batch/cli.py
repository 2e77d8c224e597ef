"""`blink run-batch -i in.jsonl -o out.jsonl`: an OpenAI batch file through blink (or any
OpenAI-compatible server), as vLLM's `run-batch`.

    flags -> read the input (batch_file.read_requests) and what -o already holds
        (batch_file.keep_done: a rerun skips those custom_ids)
    -> --url given: post there; else start `blink serve` (server.ServeChild) on a free
       port with --max-batch-size = --max-concurrency, so the runner keeps exactly the
       server's batch full
    -> the model's tokenizer for the ordering (none loadable: characters); whether the
       server caches prefixes (--prefix-cache, auto: its /metrics)
    -> runner.run_batch(order=--order) -> one summary line on stderr -> exit 0 once every
       line has its output line, failed ones included (as vLLM); 1 when the server cannot
       start, 2 when the files cannot be read
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

from ..config import API_KEY_ENV
from ..serve import DAEMON_FLAGS
from .batch_file import keep_done, read_requests
from .ordering import ORDERS

DEFAULT_CONCURRENCY = 32
# blink serve's daemon flags offered here too; --max-batch-size is --max-concurrency's.
SERVE_FLAGS = tuple(f for f in DAEMON_FLAGS if f[0] != "--max-batch-size")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--input-file", required=True, help="batch input (.jsonl): custom_id, method, url, body")
    p.add_argument("-o", "--output-file", required=True,
                   help="batch output (.jsonl), appended as results come; a rerun skips custom_ids it answered")
    p.add_argument("--url", default=None,
                   help="post to this OpenAI-compatible server (http://host:port[/v1]) instead of starting blink serve")
    p.add_argument("--order", choices=ORDERS, default="blend",
                   help="blend (default): shared prefixes together, long prompts and long outputs mixed "
                        "(BlendServe); file: the input's order")
    p.add_argument("--prefix-cache", choices=("auto", "on", "off"), default="auto",
                   help="whether the server caches prompt prefixes (blend order: shared prefixes paid once, "
                        "each group led by one request); auto: a prefix_cache metric on its /metrics")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help=f"requests in flight at most (default {DEFAULT_CONCURRENCY}); the started server "
                        f"gets it as --max-batch-size; with --url set it to that server's batch size")
    p.add_argument("--model", default="default",
                   help="model to serve (as blink serve --model), and whose tokenizer orders the batch")
    p.add_argument("--api-key", default=None, help=f"bearer key for the server (default ${API_KEY_ENV})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    group = p.add_argument_group("the started blink serve (without --url)")
    group.add_argument("--executor", default="cpu", help="daemon executor: cpu | cuda | cuda-hostloop")
    group.add_argument("--ready-timeout-s", type=float, default=600.0, help="give up if not healthy after this long")
    for flag, kind, help_text in SERVE_FLAGS:
        group.add_argument(flag, type=kind, default=None, help=help_text)


def serve_args(args: argparse.Namespace, concurrency: int) -> list[str]:
    out = ["--model", args.model, "--executor", args.executor, "--max-batch-size", str(concurrency)]
    for flag, _, _ in SERVE_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    return out


def _tokenizer(model: str):
    from ..tokenizer import TokenizerError, load_tokenizer
    try:
        return load_tokenizer(model)
    except (TokenizerError, OSError, ValueError) as e:
        print(f"blink run-batch: no tokenizer for {model!r} ({e}); ordering by characters", file=sys.stderr)
        return None


def run(args: argparse.Namespace) -> int:
    from .runner import base_of, run_batch
    from .server import ServeChild, ServeError
    concurrency = args.max_concurrency or DEFAULT_CONCURRENCY
    if concurrency < 1:
        print("blink run-batch: --max-concurrency must be at least 1", file=sys.stderr)
        return 2
    try:
        items = read_requests(args.input_file)
        done = keep_done(args.output_file)
    except OSError as e:
        print(f"blink run-batch: {e}", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    tokenizer = _tokenizer(args.model)
    server = None
    try:
        if args.url:
            url = base_of(args.url)
        else:
            server = ServeChild(serve_args(args, concurrency), args.ready_timeout_s, api_key)
            print(f"blink run-batch: starting blink serve ({args.model}, {args.executor}, "
                  f"batch {concurrency}) on {server.url}", file=sys.stderr, flush=True)
            url = server.start()
        summary = asyncio.run(run_batch(items, done, url, args.output_file, order=args.order,
                                        concurrency=concurrency, tokenizer=tokenizer, api_key=api_key,
                                        show_progress=not args.no_progress,
                                        prefix_cache={"auto": None, "on": True, "off": False}[args.prefix_cache]))
    except ServeError as e:
        print(f"blink run-batch: {e}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    print(f"blink run-batch: {summary.line()} -> {args.output_file}", file=sys.stderr, flush=True)
    return 0
