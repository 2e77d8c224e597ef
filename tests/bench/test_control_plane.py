"""bench.control_plane end to end on a tiny budget: the bare aiohttp server, blink (null daemon
+ frontend) as real processes and the load generator, both phases (saturated, paced), and the
JSON and markdown it writes."""
from __future__ import annotations

import json
import subprocess
import sys


def test_control_plane_bench_runs_both_phases_and_writes_its_results(tmp_path):
    cmd = [sys.executable, "-m", "bench.control_plane", "--concurrency", "1,2", "--duration-s", "0.6",
           "--warmup-s", "0.2", "--repeats", "1", "--max-tokens", "32", "--paced-step-ms", "5", "--no-pin",
           "--loop", "asyncio", "--date", "2000-01-01", "--machine", "test", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads((tmp_path / "2000-01-01-test-control-plane.json").read_text())
    seen = {(r["phase"], r["server"], r["concurrency"]) for r in data["runs"]}
    for c in (1, 2):
        for want in (("saturated", "blink", c), ("saturated", "bare", c), ("saturated", "bare-1tok", c),
                     ("paced", "blink", c), ("paced", "bare", c), ("turnaround", "blink", c),
                     ("turnaround", "bare", c)):
            assert want in seen, (want, sorted(seen))
    for r in data["runs"]:
        assert r["events"] > 0 and r["tokens"] >= r["events"], r
    md = (tmp_path / "2000-01-01-test-control-plane.md").read_text()
    assert "## Saturated: throughput" in md and "## Paced (5 ms per step)" in md and "## Targets" in md
    assert "## Turnaround: one-token requests" in md
    for r in data["summary"]["turnaround_rows"]:
        assert r["blink_requests_per_s"] > 0 and r["bare_requests_per_s"] > 0
    assert data["loop"] == "asyncio"


def test_load_generator_stream_reads_split_chunks_and_ends_at_the_zero_chunk():
    import asyncio

    from bench.control_plane import _SseStream

    def chunk(ev):   # HTTP/1.1 chunked framing
        return b"%x\r\n%b\r\n" % (len(ev), ev)

    def timed(t_last, n):
        return chunk(b'data: {"id":"x","blink_timing":{"t_last_ns":%d,"t_frontend_ns":%d,"n_tokens":%d}}\n\n' % (
            t_last, t_last + 5, n))

    body = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            + timed(100, 1) + timed(200, 3) + chunk(b'data: {"usage": {}}\n\n') + chunk(b"data: [DONE]\n\n")
            + b"0\r\n\r\n")

    class Sink:
        def __init__(self):
            self.sent = b""

        def write(self, raw):
            self.sent += raw

    async def feed(pieces):
        seen = []
        s = _SseStream(lambda t, last, front, n: seen.append((last, front, n)))
        s.connection_made(Sink())
        done = s.request(b"POST / HTTP/1.1\r\n\r\n")
        for p in pieces:
            assert not done.done()
            s.data_received(p)
        return seen, done.done() and done.result()

    cuts = [1, 20, 90, 95, 150, len(body) - 3, len(body) - 1]
    for cut in cuts:   # every split point: the head, inside a timing field, inside the zero chunk
        seen, ok = asyncio.run(feed([body[:cut], body[cut:]]))
        assert seen == [(100, 105, 1), (200, 205, 3)] and ok, cut
    seen, ok = asyncio.run(feed([bytes([b]) for b in body]))   # one byte a read
    assert seen == [(100, 105, 1), (200, 205, 3)] and ok
    err = b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 2\r\n\r\n{}"
    assert asyncio.run(feed([err])) == ([], False)
