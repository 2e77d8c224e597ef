"""The OpenAI API through the verbs transport on a real RDMA device, as real processes.

    blink gpu-daemon --transport verbs (shm ring + RDMA bootstrap on 127.0.0.1)
        <- RDMA (rxe0 loopback) <- blink frontend --transport verbs --daemon ...  <- openai client
        <- shared memory        <- blink frontend --ring ...                      <- openai client

A ring has one frontend at a time (attaching bumps the frontend epoch and takes the
ring over), so the two frontends take turns on one daemon: the same requests must get
the same answers through both. Then what the verbs side does when the ring is full,
when the daemon dies and comes back, and when the frontend dies mid-stream. Marked
`rdma`: skipped without a device; `scripts/test.sh -m rdma` runs them in a soft-RoCE
guest (scripts/rdma_vm.sh), where they are slow: every process runs under emulation.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

import openai
import pytest

from frontend_procs import REPO, blink, free_port, smollm2
from shared_layout import BackendStatus, Ring
from shared_layout.shm import ShmRegion

pytestmark = [pytest.mark.rdma, pytest.mark.slow, pytest.mark.timeout(900)]
START_TIMEOUT_S = float(os.environ.get("BLINK_TEST_START_TIMEOUT_S", "240"))   # emulated guests are slow


class Proc:
    """A `blink` child whose output goes to a file (read on failure)."""

    def __init__(self, argv: list[str], log_path):
        self.argv, self.log_path = argv, log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONPATH=str(REPO)))

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.log.close()
        return rc


class Daemon(Proc):
    """`blink gpu-daemon --transport verbs`, READY in its shm ring."""

    def __init__(self, tmp_path, ring: str, rdma_port: int, model: str = "null", slots: int = 64, epoch: int = 1,
                 *extra: str, start_timeout_s: float = START_TIMEOUT_S):
        self.ring, self.rdma_port = ring, rdma_port
        super().__init__([*blink(), "gpu-daemon", "--model", model, "--ring", ring, "--slots", str(slots), *extra,
                          "--prompt-arena-tokens", "65536", "--output-arena-tokens", "65536",
                          "--transport", "verbs", "--rdma-listen", f"127.0.0.1:{rdma_port}"],
                         tmp_path / f"daemon-{epoch}.log")
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            assert self.alive(), f"daemon exited early:\n{self.output()}"
            if self._ready(epoch):
                return
            time.sleep(0.2)
        self.stop(signal.SIGKILL)
        raise AssertionError(f"daemon not READY after {start_timeout_s} s:\n{self.output()}")

    def _ready(self, epoch: int) -> bool:
        if not ShmRegion.exists(self.ring):
            return False
        try:
            ring = Ring.attach(ShmRegion.open(self.ring).buf)
        except Exception:
            return False
        return ring.get("backend_epoch") == epoch and ring.get("backend_status") == BackendStatus.READY \
            and "RDMA bootstrap on" in self.output()


class Frontend(Proc):
    """`blink frontend` over verbs (`daemon` given) or shared memory, healthy on a free port."""

    def __init__(self, tmp_path, ring: str, model: str = "null", daemon: Daemon | None = None, *extra: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        via = ["--transport", "verbs", "--daemon", f"127.0.0.1:{daemon.rdma_port}"] if daemon else []
        name = "verbs" if daemon else "shm"
        super().__init__([*blink(), "frontend", "--model", model, "--ring", ring, "--port", str(self.port),
                          "--startup-timeout-s", "120", *via, *extra],
                         tmp_path / f"frontend-{name}-{self.port}.log")
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0, timeout=300)
        deadline = time.monotonic() + START_TIMEOUT_S
        while health(self.base) != 200:
            assert self.alive(), f"frontend exited early:\n{self.output()}"
            if time.monotonic() > deadline:
                self.stop(signal.SIGKILL)
                raise AssertionError(f"frontend not healthy after {START_TIMEOUT_S} s:\n{self.output()}")
            time.sleep(0.2)


def health(base: str) -> int:
    """/health's status, 0 when nobody answers in time (a frontend mid-reconnect may be busy)."""
    try:
        with urllib.request.urlopen(base + "/health", timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:   # refused, reset or timed out
        return 0


def echo(prompt: list[int], n: int) -> list[int]:
    return [prompt[i % len(prompt)] for i in range(n)]


def words(i: int) -> list[int]:
    return smollm2().encode(f" stream {i} says hello to number {i * 7} and", add_special_tokens=False)


def answers(client: openai.OpenAI, model: str, max_tokens: int = 12) -> list:
    """A fixed set of requests; what comes back, in a form to compare across transports."""
    out = []
    r = client.completions.create(model=model, prompt=words(1), max_tokens=max_tokens, temperature=0)
    out.append(("completion", r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens))
    r = client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    out.append(("chat", r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens))
    chunks = client.completions.create(model=model, prompt="Soft RoCE carries the ring", max_tokens=max_tokens,
                                       temperature=0, stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    for c in chunks:
        text += "".join(ch.text for ch in c.choices)
        usage = c.usage or usage
    out.append(("stream", text, usage.completion_tokens))
    return out


@pytest.fixture
def ring():
    name = f"blink-test-verbs-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    yield name
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass


@pytest.fixture
def procs():
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop(signal.SIGKILL)


def test_the_openai_client_gets_the_same_answers_through_verbs_as_through_shm(tmp_path, ring, procs):
    daemon = Daemon(tmp_path, ring, free_port())
    procs.append(daemon)
    fe = Frontend(tmp_path, ring, "null", daemon)
    procs.append(fe)
    through_verbs = answers(fe.client, "null")
    prompt = words(2)
    r = fe.client.completions.create(model="null", prompt=prompt, max_tokens=40, temperature=0)
    assert smollm2().encode(r.choices[0].text, add_special_tokens=False) == echo(prompt, 40)
    assert fe.stop() == 0, fe.output()
    assert "Traceback" not in fe.output()

    fe = Frontend(tmp_path, ring, "null")   # the same daemon, now over shared memory
    procs.append(fe)
    assert answers(fe.client, "null") == through_verbs
    assert fe.stop() == 0, fe.output()
    assert daemon.alive()


async def test_concurrent_streams_through_verbs_each_get_their_own_tokens(tmp_path, ring, procs):
    daemon = Daemon(tmp_path, ring, free_port())
    procs.append(daemon)
    fe = Frontend(tmp_path, ring, "null", daemon)
    procs.append(fe)
    client = openai.AsyncOpenAI(base_url=fe.base + "/v1", api_key="none", max_retries=0, timeout=300)

    async def one(i: int) -> tuple[int, str]:
        text = ""
        async for c in await client.completions.create(model="null", prompt=words(i), max_tokens=30,
                                                       temperature=0, stream=True):
            text += "".join(ch.text for ch in c.choices)
        return i, text

    for i, text in await asyncio.gather(*(one(i) for i in range(8))):
        assert smollm2().encode(text, add_special_tokens=False) == echo(words(i), 30), i
    await client.close()


async def test_a_full_ring_refuses_with_429_and_loses_nothing_else(tmp_path, ring, procs):
    daemon = Daemon(tmp_path, ring, free_port(), slots=4)
    procs.append(daemon)
    # a queue of one: the 6th request waiting at once is refused; the timeout only has to
    # outlast admission under emulation (0.05 s refused every request in a guest)
    fe = Frontend(tmp_path, ring, "null", daemon, "--max-queue", "1", "--queue-timeout-s", "5")
    procs.append(fe)
    client = openai.AsyncOpenAI(base_url=fe.base + "/v1", api_key="none", max_retries=0, timeout=300)

    async def one(i: int):
        try:
            r = await client.completions.create(model="null", prompt=words(i), max_tokens=400, temperature=0)
        except openai.RateLimitError as e:
            return i, e
        return i, r

    results = await asyncio.gather(*(one(i) for i in range(16)))
    refused = [(i, r) for i, r in results if isinstance(r, openai.RateLimitError)]
    served = [(i, r) for i, r in results if not isinstance(r, openai.RateLimitError)]
    assert refused, "16 requests at once on 4 slots with a queue of 1: some must be refused"
    assert served, "the first requests hold the slots and must be served"
    for _, e in refused:
        assert e.status_code == 429 and "busy" in e.message
    for i, r in served:   # every accepted request ends with its full output
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 400
        assert smollm2().encode(r.choices[0].text, add_special_tokens=False) == echo(words(i), 400), i
    r = await client.completions.create(model="null", prompt=words(99), max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5   # the ring is free again
    await client.close()


def test_the_verbs_frontend_rides_out_a_daemon_restart(tmp_path, ring, procs):
    port = free_port()
    daemon = Daemon(tmp_path, ring, port)
    procs.append(daemon)
    fe = Frontend(tmp_path, ring, "null", daemon)
    procs.append(fe)
    assert fe.client.completions.create(model="null", prompt=words(3), max_tokens=4).usage.completion_tokens == 4

    daemon.stop(signal.SIGKILL)          # the peer disappears without a word
    deadline = time.monotonic() + 60
    while health(fe.base) == 200:
        assert time.monotonic() < deadline, "the verbs frontend never noticed the daemon die"
        time.sleep(0.2)
    with pytest.raises(openai.APIStatusError) as e:
        fe.client.completions.create(model="null", prompt=words(4), max_tokens=4)
    assert e.value.status_code == 503    # a clear error, not a hang or a 500
    assert fe.alive()

    daemon = Daemon(tmp_path, ring, port, epoch=2)   # back on the same ring and address
    procs.append(daemon)
    deadline = time.monotonic() + START_TIMEOUT_S
    while health(fe.base) != 200:
        assert time.monotonic() < deadline, f"the verbs frontend never reconnected:\n{fe.output()}"
        time.sleep(0.2)
    prompt = words(5)
    r = fe.client.completions.create(model="null", prompt=prompt, max_tokens=9, temperature=0)
    assert smollm2().encode(r.choices[0].text, add_special_tokens=False) == echo(prompt, 9)
    assert "Traceback" not in fe.output()


async def test_a_frontend_killed_mid_stream_costs_only_its_own_requests(tmp_path, ring, procs):
    daemon = Daemon(tmp_path, ring, free_port())
    procs.append(daemon)
    fe = Frontend(tmp_path, ring, "null", daemon)
    procs.append(fe)
    client = openai.AsyncOpenAI(base_url=fe.base + "/v1", api_key="none", max_retries=0, timeout=300)
    stream = await client.completions.create(model="null", prompt=words(6), max_tokens=4000, stream=True)
    async for _ in stream:
        break                            # the stream is flowing
    fe.stop(signal.SIGKILL)
    await client.close()

    fe = Frontend(tmp_path, ring, "null", daemon)   # a new frontend takes the ring over through RDMA
    procs.append(fe)
    prompt = words(7)
    r = fe.client.completions.create(model="null", prompt=prompt, max_tokens=12, temperature=0)
    assert smollm2().encode(r.choices[0].text, add_special_tokens=False) == echo(prompt, 12)
    assert daemon.alive()


@pytest.mark.timeout(1800)
def test_the_embedded_model_answers_the_same_through_verbs_as_through_shm(tmp_path, ring, procs):
    """SmolLM2-135M on the CPU executor behind RDMA: greedy answers equal the shared-memory ones."""
    # float32: an emulated CPU may claim bf16 support it then runs very slowly
    daemon = Daemon(tmp_path, ring, free_port(), "default", 8, 1, "--dtype", "float32",
                    start_timeout_s=3 * START_TIMEOUT_S)
    procs.append(daemon)
    fe = Frontend(tmp_path, ring, "default", daemon)
    procs.append(fe)
    model = fe.client.models.list().data[0].id
    through_verbs = answers(fe.client, model, max_tokens=6)
    assert all(a[-1] > 0 for a in through_verbs)
    assert fe.stop() == 0, fe.output()
    fe = Frontend(tmp_path, ring, "default")
    procs.append(fe)
    assert answers(fe.client, model, max_tokens=6) == through_verbs
