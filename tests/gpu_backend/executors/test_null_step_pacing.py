"""The null executor's step pacing (`blink gpu-daemon --model null --step-ms N`): each engine
step takes at least N ms, tokens are still the prompt's echo, and 0 keeps the old
as-fast-as-possible behaviour. Real Engine over a Ring in a bytearray, FrontendPlayer as frontend."""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import pytest

from gpu_backend import cli as daemon_cli
from gpu_backend.engine import Engine, EngineConfig
from gpu_backend.executors import ExecutorOptions
from gpu_backend.executors.null import EchoRunner, NullExecutor
from gpu_backend.scheduler.intake import IntakeConfig
from gpu_backend.scheduler.policy import PolicyConfig
from shared_layout import FinishReason, Ring, RingGeometry

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from frontend_player import FrontendPlayer  # noqa: E402

GEOM = RingGeometry(16, 4096, 4096)


def make_engine(runner: EchoRunner) -> tuple[Engine, FrontendPlayer, Ring]:
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    policy = PolicyConfig(max_batch_size=8, max_prefill_tokens=4096, block_size=16)
    engine = Engine(ring, runner, EngineConfig(policy, num_blocks=256), IntakeConfig(1000, 1024, eos_ids=()))
    return engine, FrontendPlayer(ring), ring


def run_to_completion(engine: Engine, fe: FrontendPlayer, slots: list[int]) -> tuple[dict, list[float]]:
    """Step until every slot completes; returns ({slot: (Result, t_last_ns)}, durations of the steps)."""
    out, steps = {}, []
    for _ in range(10_000):
        for s in [s for s in slots if s not in out and fe.done(s)]:
            t_last = int(fe.ring.slots[s]["t_last_ns"])
            out[s] = (fe.collect(s), t_last)
        if len(out) == len(slots):
            return out, steps
        t0 = time.perf_counter()
        if engine.step():
            steps.append(time.perf_counter() - t0)
    raise AssertionError("engine did not finish")


def test_paced_steps_take_at_least_step_time_and_echo_the_prompt():
    step_s = 0.02
    engine, fe, _ = make_engine(EchoRunner(step_s))
    prompts = {fe.submit([5, 6, 7], 6): [5, 6, 7], fe.submit([9, 8], 6): [9, 8]}
    res, steps = run_to_completion(engine, fe, list(prompts))
    for slot, prompt in prompts.items():
        r, t_last_ns = res[slot]
        assert r.finish == FinishReason.LENGTH
        assert r.tokens == [prompt[i % len(prompt)] for i in range(6)]
        # Tokens 2..6 each came one paced decode step after the one before.
        assert (t_last_ns - r.t_first_ns) / 1e9 >= 5 * step_s * 0.98
    # Both requests decode together: one prefill step plus five decode steps, every one paced.
    assert len(steps) == 6
    assert min(steps) >= step_s * 0.98
    assert max(steps) < step_s + 0.05   # sleeps are bounded (generous on a loaded 2-core box)


def test_unpaced_runner_is_as_fast_as_before():
    engine, fe, _ = make_engine(EchoRunner())
    slot = fe.submit([1, 2, 3, 4], 200)
    t0 = time.perf_counter()
    res, steps = run_to_completion(engine, fe, [slot])
    assert res[slot][0].tokens == [[1, 2, 3, 4][i % 4] for i in range(200)]
    assert len(steps) == 200
    assert time.perf_counter() - t0 < 200 * 0.005   # far below any pacing: no sleeps in the step


def test_negative_step_time_is_rejected():
    with pytest.raises(ValueError):
        EchoRunner(-0.001)


def test_executor_options_carry_step_ms_to_the_runner(monkeypatch):
    seen = {}

    class Probe(Engine):
        def serve(self, stop):
            seen["step_s"] = self.runner.step_s

    monkeypatch.setattr("gpu_backend.executors.null.Engine", Probe)
    ring = Ring.create(bytearray(GEOM.total_size), GEOM)
    NullExecutor(ExecutorOptions(model="null", step_ms=20.0, max_batch_size=4)).serve(ring, None)
    assert seen["step_s"] == pytest.approx(0.02)


def daemon_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    daemon_cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_step_ms_flag_parses_and_rejects_bad_values(capsys):
    assert daemon_args("--model", "null", "--step-ms", "20").step_ms == 20.0
    assert daemon_args("--model", "null").step_ms == 0.0
    with pytest.raises(SystemExit):
        daemon_args("--model", "null", "--step-ms", "-1")
    # Pacing a real model would only slow it down: refused with one line, exit 2.
    assert daemon_cli.run(daemon_args("--model", "default", "--step-ms", "20")) == 2
    assert "--step-ms" in capsys.readouterr().err
