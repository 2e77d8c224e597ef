"""Runs a parsed batch file against an OpenAI-compatible server and writes its output file.

    [BatchRequest | BadLine], done custom_ids (a rerun)
      -> bad lines: an error line each, at once
      -> requests not done: prompts.work_item() -> ordering.plan(order, prefix_cache: does
         the server's /metrics show a prefix cache) -> Plan
      -> submit in plan order, at most `concurrency` in flight (a prefix group's members
         only after their leader finished): POST base_url + url with the body
      -> every response, as it comes: batch_file.response_line() appended to the output
         file and flushed, the progress bar advanced
    429 / 503 and refused connections (a full server, a daemon being restarted by
    `blink serve`) are retried with backoff (RETRY_DELAYS_S); any other answer is final.

asyncio and aiohttp, one event loop; the output file is written from the loop only.
"""
from __future__ import annotations

import asyncio
import dataclasses
import heapq
import json
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from ..tokenizer import ModelTokenizer
from . import ordering
from .batch_file import BadLine, BatchRequest, OutputFile, bad_line_output, response_line
from .progress import progress
from .prompts import work_item

RETRY_STATUSES = (429, 503)
RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 16.0)


@dataclasses.dataclass
class Summary:
    total: int = 0          # lines in the input file
    skipped: int = 0        # custom_ids an earlier run already answered
    ok: int = 0
    failed: int = 0         # error lines written (bad lines included)
    makespan_s: float = 0.0 # first request sent to last response, requests only

    def line(self) -> str:
        return (f"{self.ok} ok, {self.failed} failed, {self.skipped} already done, "
                f"of {self.total} lines; {self.makespan_s:.1f} s")


def base_of(url: str) -> str:
    """The server's root URL from what a user passes: http://host:port, with or without /v1."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _error_body(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


async def send(session: aiohttp.ClientSession, base_url: str, request: BatchRequest,
               headers: dict[str, str], delays_s: Sequence[float] = RETRY_DELAYS_S) -> dict[str, Any]:
    """POST one request; its output line."""
    error: Any = None
    status = 503
    for attempt in range(len(delays_s) + 1):
        try:
            async with session.post(base_url + request.url, json=request.body, headers=headers) as r:
                status, text = r.status, await r.text()
                request_id = r.headers.get("x-request-id")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            status, error = 503, f"could not reach the server: {type(e).__name__}: {e}"
        else:
            if status == 200:
                try:
                    return response_line(request.custom_id, 200, json.loads(text), request_id=request_id)
                except ValueError:
                    return response_line(request.custom_id, 502, None, f"the server's answer is not JSON: {text[:200]}")
            error = _error_body(text)
            if status not in RETRY_STATUSES:
                break
        if attempt < len(delays_s):
            await asyncio.sleep(delays_s[attempt])
    return response_line(request.custom_id, status, None, error)


async def caches_prefixes(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> bool:
    """Whether the server says it keeps a prefix cache: a prefix_cache metric on its /metrics
    (vLLM: vllm:prefix_cache_queries); no /metrics, or none such: no."""
    try:
        async with session.get(base_url + "/metrics", headers=headers) as r:
            return r.status == 200 and "prefix_cache" in (await r.text()).lower()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


async def run_batch(items: Sequence[BatchRequest | BadLine], done: set[str], base_url: str, output_path: str,
                    *, order: str = "blend", concurrency: int = 32, tokenizer: ModelTokenizer | None = None,
                    api_key: str | None = None, show_progress: bool = True, prefix_cache: bool | None = None,
                    delays_s: Sequence[float] = RETRY_DELAYS_S) -> Summary:
    """Run every item not in `done`, appending one output line per item to output_path.
    prefix_cache None: ask the server's /metrics (caches_prefixes)."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    summary = Summary(total=len(items))
    todo = [it for it in items if it.custom_id is None or it.custom_id not in done]
    summary.skipped = len(items) - len(todo)
    requests = [it for it in todo if isinstance(it, BatchRequest)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if prefix_cache is None and order != "file":
            prefix_cache = await caches_prefixes(session, base_url, headers)
        plan = ordering.plan([work_item(r, tokenizer) for r in requests], order, prefix_cache=bool(prefix_cache))
        bars = progress(len(todo), enabled=show_progress)
        with OutputFile(output_path) as out:
            for it in todo:
                if isinstance(it, BadLine):
                    out.write(bad_line_output(it))
                    summary.failed += 1
                    bars.update(False)
            t0 = time.monotonic()
            await _submit(plan, requests, lambda r: send(session, base_url, r, headers, delays_s),
                          concurrency, out, summary, bars)
            summary.makespan_s = time.monotonic() - t0 if requests else 0.0
    bars.close()
    return summary


async def _submit(plan: ordering.Plan, requests: list[BatchRequest], post, concurrency: int,
                  out: OutputFile, summary: Summary, bars) -> None:
    """Plan order, bounded in flight; a member of a prefix group is ready once its leader is done."""
    rank = {i: r for r, i in enumerate(plan.order)}
    waiting: dict[int, list[int]] = {}   # leader -> its members' ranks
    ready: list[int] = []                # ranks, a heap
    for i in plan.order:
        leader = plan.leader_of.get(i)
        (waiting.setdefault(leader, []) if leader is not None else ready).append(rank[i])
    heapq.heapify(ready)
    in_flight: dict[asyncio.Task, int] = {}
    while ready or in_flight:
        while ready and len(in_flight) < concurrency:
            i = plan.order[heapq.heappop(ready)]
            in_flight[asyncio.ensure_future(post(requests[i]))] = i
        finished, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
        for task in finished:
            i = in_flight.pop(task)
            record = task.result()
            out.write(record)
            ok = record["error"] is None
            summary.ok += ok
            summary.failed += not ok
            bars.update(ok)
            for r in waiting.pop(i, ()):
                heapq.heappush(ready, r)
