"""The lent-GPU plan (scripts/gpu_plan.py) keeps the device tool's limits, its
runner (scripts/gpu_check.sh) leaves a verdict for a stage stopped at its budget,
and the GGUF's parts reassemble only into the right file (scripts/gguf_parts.py).
Fast: no GPU, no network, no virtual environment."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import shlex
import subprocess
import sys
import time

import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import gguf_parts  # noqa: E402
import gpu_plan as plan  # noqa: E402


def test_the_plan_keeps_every_limit_with_this_tree():
    tree = plan.tree_bytes()
    assert 0 < tree < plan.TREE_LIMIT
    assert plan.check_plan(tree) == []
    assert plan.CALLS[0].expected_s < plan.FIRST_CALL_MAX_S
    for c in plan.CALLS:
        assert len(c.command) <= plan.COMMAND_CHARS and c.timeout_s <= plan.CALL_LIMIT_S
        assert len(c.out_files()) <= plan.OUT_FILES
        assert tree + plan.carried_bytes(c) <= plan.TREE_LIMIT
        assert c.expected_s <= plan.EXPECTED_MAX_S and c.budget_s < c.timeout_s


def test_a_broken_plan_is_caught(monkeypatch):
    smoke = plan.CALLS[0]
    many = dataclasses.replace(smoke.stages[0], outputs=tuple(f"f{i}.json" for i in range(8)))
    slow = dataclasses.replace(smoke.stages[0], expected_s=500, budget_s=590)
    broken = (dataclasses.replace(smoke, name="b", stages=(slow,)), dataclasses.replace(smoke, name="a", stages=(many,)))
    monkeypatch.setattr(plan, "CALLS", broken)
    problems = "\n".join(plan.check_plan(1 << 20))
    assert "files in $OUT" in problems and "expects" in problems and "budgets add up" in problems
    assert "first call expects" in problems and "parts 1..3" in problems
    assert plan.check_plan(60 * plan.MIB) and "over 64 MiB" in "\n".join(plan.check_plan(60 * plan.MIB))


def test_out_names_and_depth():
    assert plan.check_out_name("smoke-graph_smoke.xml") is None
    assert plan.check_out_name("a/b/c.log") is None
    assert "folders down" in plan.check_out_name("a/b/c/d.log")
    assert "letters" in plan.check_out_name("bad name.log")
    assert "letters" in plan.check_out_name("x[1].xml")


def test_stage_lines_are_what_the_runner_reads():
    for c in plan.CALLS:
        out = subprocess.run([sys.executable, str(SCRIPTS / "gpu_plan.py"), "stages", c.name, "/o"],
                             capture_output=True, text=True, check=True).stdout.splitlines()
        assert [line.split("\t")[0] for line in out] == [s.name for s in c.stages]
        for line, s in zip(out, c.stages):
            name, budget, flags, argv = line.split("\t")
            words = shlex.split(argv)
            assert int(budget) == s.budget_s and words[0] == "python3"
            if s.pytest:
                assert "pytest" in flags and f"--junitxml=/o/{c.name}-{name}.xml" in words and "-m" in words
                assert f"--timeout={s.budget_s - 15}" in words


def test_benchmark_outputs_are_the_declared_files():
    import fnmatch

    from bench import cuda_graphs, cuda_scheduler
    bench = plan.call("bench")
    written = [f"{cuda_scheduler.DATE}-h100-cuda_scheduler.json", f"{cuda_scheduler.DATE}-h100-cuda_scheduler.md",
               f"{cuda_graphs.DATE}-h100-cuda_graphs.json", f"{cuda_graphs.DATE}-h100-cuda_graphs.md"]
    declared = bench.out_files()
    assert all(any(fnmatch.fnmatch(w, d) for d in declared) for w in written)
    assert all(plan.check_out_name(w) is None for w in written)
    assert all(("--out", "{out}") == s.argv[s.argv.index("--out"):s.argv.index("--out") + 2] for s in bench.stages)


def test_plan_prints_in_seconds():
    t0 = time.monotonic()
    res = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), "--plan"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHON=sys.executable))
    assert res.returncode == 0, res.stdout + res.stderr
    assert time.monotonic() - t0 < 10
    for c in plan.CALLS:
        assert c.command in res.stdout
    assert "plan limits: all kept" in res.stdout


def test_a_stage_stopped_at_its_budget_leaves_a_verdict_and_junit(tmp_path):
    (tmp_path / "test_sleepy.py").write_text("import time\n\ndef test_quick():\n    pass\n\n"
                                             "def test_sleeps():\n    time.sleep(300)\n")
    out = tmp_path / "out"
    t0 = time.monotonic()
    res = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), "--run-stage", "sleepy", "40", "pytest",
                          sys.executable, "-m", "pytest", str(tmp_path / "test_sleepy.py"), "-v", "-p",
                          "no:cacheprovider", f"--junitxml={out}/stage-sleepy.xml"],
                         capture_output=True, text=True, env=dict(os.environ, OUT=str(out)), cwd=tmp_path, timeout=150)
    # a 40 s budget: the child pytest's start-up alone took over 10 s on a loaded 2-core machine
    assert time.monotonic() - t0 < 120
    assert res.returncode != 0
    verdict = [x for x in res.stdout.splitlines() if x.startswith("=== stage/sleepy: ")]
    assert verdict and "TIMEOUT" in verdict[0] and "1 passed" in verdict[0], res.stdout[-2000:]
    assert (out / "stage-sleepy.xml").is_file() and (out / "stage.log").is_file()


@pytest.fixture
def small_gguf(monkeypatch, tmp_path):
    blob = os.urandom(100_003)
    monkeypatch.setattr(plan, "GGUF_BYTES", len(blob))
    monkeypatch.setattr(plan, "GGUF_SHA256", hashlib.sha256(blob).hexdigest())
    src = tmp_path / "model.gguf"
    src.write_bytes(blob)
    return src, blob


def test_gguf_parts_reassemble_over_several_calls(small_gguf, tmp_path):
    src, blob = small_gguf
    here, device = tmp_path / "here", tmp_path / "device"
    parts = gguf_parts.split(src, here)
    assert len(parts) == plan.GGUF_PARTS and sum(p.stat().st_size for p in parts) == len(blob)
    target = device / "blink-gguf" / "model.gguf"
    for k in range(1, plan.GGUF_PARTS + 1):      # each call carries one part
        carried = tmp_path / f"call{k}"
        (carried / plan.part_dir(k)).mkdir(parents=True)
        for name in ("part", "part.sha256"):
            (carried / plan.part_dir(k) / name).write_bytes((here / plan.part_dir(k) / name).read_bytes())
        status = gguf_parts.collect(carried, target)
        assert target.is_file() == (k == plan.GGUF_PARTS), status
    assert target.read_bytes() == blob and "checked" in status
    assert "already" in gguf_parts.collect(tmp_path / "call1", target)


def test_a_corrupt_part_never_becomes_the_model(small_gguf, tmp_path):
    src, _ = small_gguf
    here = tmp_path / "here"
    gguf_parts.split(src, here)
    part = here / plan.part_dir(2) / "part"
    part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(SystemExit, match="corrupt"):
        gguf_parts.collect(here, tmp_path / "device" / "model.gguf")
    assert not (tmp_path / "device" / "model.gguf").exists()
