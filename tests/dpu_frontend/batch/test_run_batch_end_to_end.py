"""`blink run-batch` as a user runs it: a subprocess that starts its own `blink serve` on the
embedded SmolLM2 model, a small file with chat, completions and a bad line, then a rerun."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

from dpu_frontend.serve import blink_command

REPO = pathlib.Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def run_batch(src: pathlib.Path, out: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([*blink_command(), "run-batch", "-i", str(src), "-o", str(out), "--max-concurrency", "4"],
                          cwd=REPO, capture_output=True, text=True, timeout=840)


def test_run_batch_answers_chat_and_completions_on_the_embedded_model(tmp_path):
    src = tmp_path / "in.jsonl"
    rows = [
        {"custom_id": "paris", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                  "max_tokens": 20, "temperature": 0}},
        {"custom_id": "count", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "1, 2, 3, 4,", "max_tokens": 6, "temperature": 0}},
    ]
    src.write_text(json.dumps(rows[0]) + "\n" + "this line is not JSON\n" + json.dumps(rows[1]) + "\n")
    out = tmp_path / "out.jsonl"
    rings_before = {n for n in os.listdir("/dev/shm") if n.startswith("blink-batch-")}
    first = run_batch(src, out)
    assert first.returncode == 0, first.stderr
    assert "Running batch" in first.stderr and "2 ok, 1 failed" in first.stderr
    got = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(got) == {"paris", "count", None}
    assert "Paris" in got["paris"]["response"]["body"]["choices"][0]["message"]["content"]
    assert got["count"]["response"]["body"]["choices"][0]["text"].lstrip().startswith("5")
    assert got[None]["response"]["status_code"] == 400 and "not JSON" in got[None]["error"]
    rings_after = {n for n in os.listdir("/dev/shm") if n.startswith("blink-batch-")}
    assert rings_after <= rings_before   # blink serve was stopped and removed its ring

    second = run_batch(src, out)   # both answered: only the bad line is reported again
    assert second.returncode == 0, second.stderr
    assert "0 ok, 1 failed, 2 already done" in second.stderr
    again = [json.loads(t) for t in out.read_text().splitlines()]
    assert sorted(str(r["custom_id"]) for r in again) == ["None", "count", "paris"]
    assert {r["custom_id"]: r["id"] for r in again if r["custom_id"]} == \
        {k: v["id"] for k, v in got.items() if k}
