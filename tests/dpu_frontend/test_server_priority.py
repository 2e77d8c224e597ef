"""`blink serve --scheduling-policy priority` driven by the official `openai` client: a
request's `priority` (extra_body, vLLM's meaning: lower first) crosses the frontend and the
ring and makes the daemon preempt a worse one (null model, one seat, paced steps)."""
from __future__ import annotations

import os
import threading
import time

import openai
import pytest

from frontend_procs import Serve

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server():
    ring = f"blink-test-prio-{os.getpid()}"
    with Serve(ring, "--model", "null", "--scheduling-policy", "priority", "--max-batch-size", "1",
               "--step-ms", "5") as s:
        yield s
        rc = s.stop()
    assert rc == 0, s.output


def test_a_better_priority_preempts_the_running_request_and_overtakes_the_queue(server):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
    done: dict[str, float] = {}

    def ask(name: str, max_tokens: int, priority: int) -> None:
        r = client.completions.create(model="null", prompt="one two three four", max_tokens=max_tokens,
                                      extra_body={"priority": priority, "ignore_eos": True})
        assert r.usage.completion_tokens == max_tokens
        done[name] = time.monotonic()

    long_low = threading.Thread(target=ask, args=("long_low", 400, 5))
    long_low.start()
    time.sleep(0.5)                       # it holds the only seat, decoding
    queued = threading.Thread(target=ask, args=("queued_low", 20, 5))
    queued.start()
    time.sleep(0.2)
    ask("high", 20, -1)                   # preempts long_low, runs before queued_low
    long_low.join(60)
    queued.join(60)
    assert done["high"] < min(done["long_low"], done["queued_low"]), done


def test_priority_out_of_range_is_a_400(server):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="null", prompt="x", max_tokens=2, extra_body={"priority": 2**31})
    assert "priority" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="null", prompt="x", max_tokens=2, extra_body={"ttft_slo_ms": 0})
