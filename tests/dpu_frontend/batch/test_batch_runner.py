"""The runner against a real `blink serve --model null` (the echo daemon: real frontend, ring and
daemon, no compute): bad lines and server-rejected bodies, resuming, and the submission order."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp

import pytest

from dpu_frontend.batch import ordering
from dpu_frontend.batch.batch_file import keep_done, read_requests
from dpu_frontend.batch.prompts import work_item
from dpu_frontend.batch.runner import base_of, caches_prefixes, run_batch
from dpu_frontend.batch.server import ServeChild
from dpu_frontend.tokenizer import load_tokenizer

pytestmark = pytest.mark.timeout(180)

SYSTEM = "You answer questions about the attached manual. " * 12


@pytest.fixture(scope="module")
def null_server():
    with ServeChild(["--model", "null"], ready_timeout_s=120) as server:
        yield server.url


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def line(custom_id, url, body, **extra):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


def chat(custom_id, text, max_tokens=4, system=None):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return line(custom_id, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens})


def completion(custom_id, prompt, max_tokens=4):
    return line(custom_id, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})


def records(path):
    return [json.loads(t) for t in path.read_text().splitlines()]


def run(path_in, path_out, url, **kw):
    items = read_requests(path_in)
    done = keep_done(path_out)
    return asyncio.run(run_batch(items, done, url, str(path_out), show_progress=False, **kw))


def test_every_line_gets_one_output_line_and_bad_ones_do_not_stop_the_batch(null_server, tmp_path, tokenizer):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        chat("chat-1", "What is the capital of France?"),
        "{this is not json",
        completion("cmpl-1", "Once upon a time"),
        line("emb-1", "/v1/embeddings", {"input": "x"}),
        completion("neg", "x", max_tokens=-1),                          # the server says 400
        line("bad-model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}),   # the server says 404
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        completion("cmpl-2", [1, 2, 3]),
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    summary = run(src, out, null_server, tokenizer=tokenizer)
    got = {(r["custom_id"], r["response"]["status_code"]) for r in records(out)}
    assert got == {("chat-1", 200), (None, 400), ("cmpl-1", 200), ("emb-1", 400), ("neg", 400),
                   ("bad-model", 404), ("cmpl-2", 200)}
    assert len(records(out)) == 8
    assert (summary.ok, summary.failed, summary.skipped, summary.total) == (3, 5, 0, 8)
    by_id = {r["custom_id"]: r for r in records(out) if r["custom_id"]}
    assert by_id["chat-1"]["response"]["body"]["object"] == "chat.completion"
    assert by_id["chat-1"]["response"]["request_id"] == by_id["chat-1"]["response"]["body"]["id"]
    assert by_id["cmpl-1"]["response"]["body"]["choices"][0]["text"]
    assert by_id["neg"]["error"]["error"]["param"] == "max_tokens"   # the server's own error object
    assert by_id["neg"]["response"]["body"] is None
    assert "/v1/embeddings" in by_id["emb-1"]["error"]


def test_a_rerun_sends_only_what_is_not_answered_yet(null_server, tmp_path, tokenizer):
    src = tmp_path / "in.jsonl"
    lines = [completion(f"c{k}", f"prompt number {k}") for k in range(6)]
    src.write_text("\n".join(lines[:4] + [completion("neg", "x", max_tokens=-1)]) + "\n")
    out = tmp_path / "out.jsonl"
    first = run(src, out, null_server, tokenizer=tokenizer)
    assert (first.ok, first.failed) == (4, 1)
    answered = {r["custom_id"]: r["id"] for r in records(out) if r["error"] is None}
    # the user fixes the bad line and adds two more; the answered four are not sent again
    src.write_text("\n".join(lines + [completion("neg", "x", max_tokens=2)]) + "\n")
    second = run(src, out, null_server, tokenizer=tokenizer)
    assert (second.ok, second.failed, second.skipped, second.total) == (3, 0, 4, 7)
    after = records(out)
    assert sorted(r["custom_id"] for r in after) == sorted(["c0", "c1", "c2", "c3", "c4", "c5", "neg"])
    assert all(r["error"] is None for r in after)
    assert {r["custom_id"]: r["id"] for r in after[:4]} == answered   # kept as they were, first


@pytest.mark.parametrize("order", ["file", "blend"])
def test_one_at_a_time_the_output_follows_the_plan(null_server, tmp_path, tokenizer, order):
    rows = []
    for k in range(3):
        rows.append(chat(f"manual-{k}", f"question {k}", max_tokens=6 - k, system=SYSTEM))
        rows.append(completion(f"story-{k}", f"Write a story about the number {k}", max_tokens=40))
        rows.append(completion(f"doc-{k}", f"Summarize: {'lorem ipsum ' * 60}{k}", max_tokens=2))
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out.jsonl"
    run(src, out, null_server, tokenizer=tokenizer, order=order, concurrency=1, prefix_cache=True)
    requests = read_requests(src)
    plan = ordering.plan([work_item(r, tokenizer) for r in requests], order)
    assert [r["custom_id"] for r in records(out)] == [requests[i].custom_id for i in plan.order]
    if order == "blend":
        # both groups (one system prompt, one document prefix) lead with their fewest output tokens
        assert sorted(requests[i].custom_id for i in plan.leaders()) == ["doc-0", "manual-2"]
        assert requests[plan.order[0]].custom_id.startswith("story")   # a long decode first


def test_base_url_takes_the_server_root_with_or_without_v1():
    assert base_of("http://h:1/v1/") == base_of("http://h:1/v1") == base_of("http://h:1") == "http://h:1"


def test_the_prefix_cache_probe_reads_the_servers_metrics(null_server):
    async def probe(url):
        async with aiohttp.ClientSession() as session:
            return await caches_prefixes(session, url, {})
    metrics = urllib.request.urlopen(null_server + "/metrics", timeout=10).read().decode()
    assert asyncio.run(probe(null_server)) is ("prefix_cache" in metrics)
    assert asyncio.run(probe("http://127.0.0.1:9")) is False   # nobody there: assume no cache


def test_blend_without_a_prefix_cache_leads_no_groups(null_server, tmp_path, tokenizer):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(chat(f"m{k}", f"question {k}", max_tokens=4 - k % 2, system=SYSTEM)
                             for k in range(4)) + "\n")
    out = tmp_path / "out.jsonl"
    summary = run(src, out, null_server, tokenizer=tokenizer, order="blend", concurrency=1, prefix_cache=False)
    assert summary.ok == 4
    requests = read_requests(src)
    plan = ordering.plan([work_item(r, tokenizer) for r in requests], "blend", prefix_cache=False)
    assert plan.leader_of == {}
    assert [r["custom_id"] for r in records(out)] == [requests[i].custom_id for i in plan.order]
