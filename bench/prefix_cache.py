"""Prefix caching: TTFT of chat requests that share a long system prompt, through `blink serve`.

    the embedded model's tokenizer -> a ~1,500-token system prompt (real text, PromptMaker)
      + 8 short user questions -> for each setting (prefix caching on, off: a fresh
      `blink serve --model default [--no-prefix-caching]` each) -> 8 streamed
      /v1/chat/completions one after another (max_tokens 1) -> TTFT of each
      -> ratio mean(TTFT of requests 2-8) / TTFT of request 1, per setting
      + the server's /metrics prefix-cache counters -> JSON + markdown

    python -m bench.prefix_cache --out bench/results/<date>-<machine>-prefix-cache

Ratios inside one server run are what count: the machine is shared and its load is
recorded at start and end. Goal (issue 23): requests 2-8 <= 0.3x request 1 with caching.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUESTIONS = ["What is the main topic of the text above?", "Name one person mentioned above.",
             "Summarize the text in one sentence.", "Which year is mentioned first?",
             "What happens at the end?", "Give the text a title.", "Is the tone formal or informal?",
             "List two places named above."]


def _ttft(url: str, model: str, messages: list[dict], timeout_s: float = 900.0) -> float:
    """Seconds from sending one streamed chat completion (max_tokens 1) to its first content chunk."""
    from bench.client import first_token_seconds
    return first_token_seconds(url, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 1,
                                                             "temperature": 0.0}, timeout_s)


def _metrics(url: str) -> dict[str, float]:
    import urllib.request
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
            if ln.startswith("blink_prefix_cache") and len(ln.split()) == 2}


def run_setting(label: str, extra: list[str], system: str, log_dir: pathlib.Path) -> dict:
    from bench.interference import stop_group
    from bench.servers import SERVED_NAME, free_port, wait_ready
    port = free_port()
    argv = [sys.executable, "-m", "dpu_frontend.cli", "serve", "--model", "default", "--port", str(port),
            "--ring", f"blink-prefix-{os.getpid()}-{port}", "--served-model-name", SERVED_NAME, *extra]
    url = f"http://127.0.0.1:{port}"
    with open(log_dir / f"prefix-cache-serve-{label}.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_ready(None, url, SERVED_NAME, timeout_s=600.0, health_path="/health")
        _ttft(url, SERVED_NAME, [{"role": "user", "content": "Hello"}])      # warm-up, no shared prefix
        ttft = []
        for q in QUESTIONS:
            # a long prefill can outlast the frontend's heartbeat window: wait for health first
            wait_ready(None, url, SERVED_NAME, timeout_s=900.0, health_path="/health")
            ttft.append(_ttft(url, SERVED_NAME, [{"role": "system", "content": system},
                                                 {"role": "user", "content": q}]))
            print(f"{label}: request {len(ttft)} TTFT {ttft[-1] * 1e3:,.0f} ms", flush=True)
        metrics = _metrics(url)
    finally:
        stop_group(proc, 20.0)
    rest = ttft[1:]
    return {"argv": argv, "ttft_s": ttft, "first_s": ttft[0], "rest_mean_s": sum(rest) / len(rest),
            "ratio": sum(rest) / len(rest) / ttft[0], "metrics": metrics}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__.split("\n")[0])
    ap.add_argument("--system-tokens", type=int, default=1500, help="length of the shared system prompt")
    ap.add_argument("--out", required=True, help="results path without suffix (.json and .md are written)")
    args = ap.parse_args(argv)
    import numpy as np
    from bench.cpu_executor import cpu_description
    from bench.workload import PromptMaker, load_tokenizer
    system, n_tokens = PromptMaker(load_tokenizer("default")).make(args.system_tokens, np.random.default_rng(0))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    runs = {"on": run_setting("on", [], system, out.parent), "off": run_setting("off", ["--no-prefix-caching"],
                                                                                 system, out.parent)}
    result = {"date": datetime.date.today().isoformat(), "cpu": cpu_description(), "cores": os.cpu_count(),
              "loadavg_start": [round(x, 2) for x in load_start],
              "loadavg_end": [round(x, 2) for x in os.getloadavg()],
              "system_prompt_tokens": n_tokens, "requests": len(QUESTIONS), "runs": runs,
              "command": "python -m bench.prefix_cache " + " ".join(argv if argv is not None else sys.argv[1:])}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    cpu = result["cpu"]
    lines = [f"# Prefix caching: {len(QUESTIONS)} chats sharing a {n_tokens}-token system prompt ({result['date']})",
             "", f"CPU: {cpu['model']} ({result['cores']} cores), flags {' '.join(cpu['simd_flags'])}, quantized "
             f"matmuls {cpu['quant_isa']}. Load average at start: {result['loadavg_start']} (end: "
             f"{result['loadavg_end']}); the machine is shared, so the ratios within one server run count, "
             "not the absolute times.", "", f"Command: `{result['command']}`", "",
             "Each setting is a fresh `blink serve --model default` (embedded SmolLM2-135M, default settings), "
             "one streamed /v1/chat/completions request at a time, max_tokens 1, a warm-up request first.", "",
             "| prefix caching | request 1 TTFT | requests 2-8 mean TTFT | ratio | hit tokens | miss tokens |",
             "|---|---|---|---|---|---|"]
    for label, r in runs.items():
        m = r["metrics"]
        hits = m.get('blink_prefix_cache_hits_total{unit="tokens"}')
        misses = m.get('blink_prefix_cache_misses_total{unit="tokens"}')
        lines.append(f"| {label} | {r['first_s'] * 1e3:,.0f} ms | {r['rest_mean_s'] * 1e3:,.0f} ms | "
                     f"{r['ratio']:.3f}x | {'-' if hits is None else int(hits)} | "
                     f"{'-' if misses is None else int(misses)} |")
    lines += ["", "Per request TTFT (ms): " + "; ".join(
        f"{label}: " + ", ".join(f"{t * 1e3:,.0f}" for t in r["ttft_s"]) for label, r in runs.items()),
        "", "Goal (issue 23): requests 2-8 <= 0.3x request 1's TTFT with prefix caching: "
        + ("met" if runs["on"]["ratio"] <= 0.3 else "not met") + f" ({runs['on']['ratio']:.3f}x)."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
