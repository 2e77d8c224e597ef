"""The rehearsal of the GPU plan (scripts/gpu_plan.py) on a machine without a GPU:
every part of it that needs none, as close to the lent H100 as this machine
allows, so the first lent run does not fail on a packaging, size or collection
slip. `scripts/gpu_check.sh --rehearse` runs it; exit 1 on any problem.

    prepare     the carried artefacts as --prepare makes them (.whl, .gpu_carry)
    plan        the plan's limits with the real sizes on disk (gpu_plan.check_plan)
    image_venv  a virtual environment standing for the GPU image: python 3.12, numpy
                2.5.2, cuda-bindings 13.0.3, the image's other packages, no torch (no
                CPU build of torch for python 3.12 can be had here); cached
    carried     the carried wheels installed as on the device: pip --no-index --no-deps
    imports     the tree byte-compiles under 3.12; every third-party import of the code
                the device runs is an image package or a carried wheel (uncovered_imports,
                also a unit test); every module of shared_layout, dpu_frontend and
                gpu_backend imports with the carried wheels (those needing torch: only
                torch missing); every cuda.bindings.driver name the code uses exists
    child_env   a process started with child_env() resolves every module as its parent
    torch_venv  python 3.11 + torch 2.13.0+cpu (the closest CPU build this machine's
                index holds; the image has 2.11.0+cu130 on 3.12) + the image's packages;
                the carried pins as 3.11 wheels (the cp312 ones do not install on 3.11)
    collect     pytest --collect-only -m gpu: no import errors; each plan stage collects
    nvcc        every .cu for sm_90a with warnings as errors; the twin with -Werror
    twin        the twin's tests (tests/gpu_backend/cuda, not gpu-marked)
    triton      every Triton kernel variant of the step graphs compiled for sm_90 ahead of time
                (gpu_backend.graphs.triton_aot: Triton's own ptxas, no GPU), float32 and bf16, and
                the kernels' diff tests under Triton's interpreter (the image's Triton is 3.6)
    runner      gpu_check.sh --call CALL, dry (pytest --collect-only), for every call:
                verdict lines, junit files, and $OUT within the tool's limits
    timeout     a stage past its budget is stopped and still leaves a verdict and junit

Virtual environments are cached under ~/.cache/blink/rehearse/<hash of the pins>.
"""
from __future__ import annotations

import ast
import fnmatch
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_plan as plan  # noqa: E402

REPO = plan.REPO
CACHE = pathlib.Path(os.environ.get("BLINK_REHEARSE_CACHE", "~/.cache/blink/rehearse")).expanduser()
PY312 = [os.path.expanduser("~/.pyenv/versions/3.12.1/bin/python3.12"), "/usr/bin/python3.12", "python3.12"]
PY311 = [os.path.expanduser("~/.pyenv/versions/3.11.7/bin/python3.11"), "/usr/bin/python3.11", "python3.11"]
COMMON = ["aiohttp", "tokenizers==0.23.2", "uvloop", "jinja2", "pytest", "pytest-timeout", "hypothesis", "pyyaml",
          "requests", "tqdm", "safetensors==0.8.0", "psutil", "nvidia-ml-py"]
IMAGE_PINS = ["numpy==2.5.2", "cuda-bindings==13.0.3", *COMMON]
# pytest-xdist: here only (the triton stage's interpreter tests over every core), never on the device
TORCH_PINS = ["torch==2.13.0+cpu", "numpy==2.4.6", "cuda-bindings==13.0.3", "triton==3.6.0", "pytest-xdist==3.8.0",
              *COMMON]
DEVICE_CODE = ["shared_layout", "dpu_frontend", "gpu_backend", "bench",   # bench: `blink bench` too (call cpu_host)
               "tests/gpu_backend/cpu_kernels", "tests/gpu_backend/executors",
               "tests/conftest.py", "tests/gpu_backend/conftest.py", "tests/gpu_backend/frontend_player.py",
               "tests/gpu_backend/cuda", "tests/gpu_backend/graphs", "scripts/gpu_plan.py", "scripts/gguf_parts.py"]
LOCAL_ROOTS = {"shared_layout", "dpu_frontend", "gpu_backend", "bench", "tests", "gpu_plan"}
# imports the device never reaches: optional extras behind try/except or a skip
OPTIONAL = {"pyverbs": "RDMA transport: tests skip without it", "openai": "bench client, not in the plan",
            "matplotlib": "plots, not in the plan", "schemathesis": "API fuzz tests, not in the plan",
            "pytest_asyncio": "not in the image: GPU tests use asyncio.run", "tensorrt": "probe skips without it",
            "pytest_aiohttp": "not in the image", "vllm": "peer server, not in the plan"}
DIST_OF = {"yaml": "pyyaml", "cuda": "cuda-bindings", "pynvml": "nvidia-ml-py", "pytest_timeout": "pytest-timeout",
           "_pytest": "pytest", "aiohttp": "aiohttp"}


class Failed(Exception):
    pass


def sh(argv, budget_s: float, **kw) -> str:
    """Run under a time budget; Failed with the output's tail on a non-zero exit or a timeout."""
    try:
        res = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=budget_s, **kw)
    except subprocess.TimeoutExpired:
        raise Failed(f"{argv[0]} ... timed out after {budget_s} s") from None
    out = res.stdout + res.stderr
    if res.returncode != 0:
        raise Failed(f"{' '.join(map(str, argv))[:200]} -> rc {res.returncode}\n{out[-3000:]}")
    return out


def find_python(cands: list[str]) -> str:
    for c in cands:
        path = shutil.which(c) or (c if os.path.isfile(c) else None)
        if path:
            return path
    raise Failed(f"none of {cands} is installed")


def venv(name: str, python: str, pins: list[str], budget_s: float) -> pathlib.Path:
    """A cached virtual environment with exactly `pins` (binary wheels only)."""
    key = hashlib.sha256(json.dumps([python, pins]).encode()).hexdigest()[:12]
    root = CACHE / f"{name}-{key}"
    if (root / ".complete").exists():
        return root / "bin" / "python"
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    sh([python, "-m", "venv", root], 120)
    sh([root / "bin" / "python", "-m", "pip", "install", "-q", "--only-binary=:all:", *pins], budget_s)
    (root / ".complete").write_text("\n".join(pins) + "\n")
    return root / "bin" / "python"


# -- stages -----------------------------------------------------------------------------------

def stage_prepare(ctx) -> str:
    wheels_ok = not plan.missing_wheels()
    parts_ok = all((REPO / plan.part_dir(k) / "part").is_file() for k in range(1, plan.GGUF_PARTS + 1))
    if not (wheels_ok and parts_ok):
        sh(["bash", "scripts/gpu_check.sh", "--prepare"], 300, cwd=REPO, env=dict(os.environ, PYTHON=sys.executable))
    ignored = sh(["git", "check-ignore", plan.WHEEL_DIR, plan.CARRY_DIR], 30, cwd=REPO).split()
    if set(ignored) != {plan.WHEEL_DIR, plan.CARRY_DIR}:
        raise Failed(f"carried folders must be ignored by git (they would travel twice): {ignored}")
    if plan.missing_wheels():
        raise Failed(f"--prepare left wheels missing from {plan.WHEEL_DIR}/: {plan.missing_wheels()}")
    return f"{plan.WHEEL_DIR}: {sorted(p.name for p in (REPO / plan.WHEEL_DIR).glob('*.whl'))}; " \
           f"{plan.GGUF_PARTS} GGUF parts"


def stage_plan(ctx) -> str:
    tree = plan.tree_bytes()
    problems = plan.check_plan(tree)
    for c in plan.CALLS:        # with the carried paths as they are on disk now
        total = tree + plan.carried_bytes(c, planned=False)
        if total > plan.TREE_LIMIT:
            problems.append(f"call {c.name}: {total / plan.MIB:.1f} MiB would travel")
    if problems:
        raise Failed("\n".join(problems))
    worst = max(tree + plan.carried_bytes(c, planned=False) for c in plan.CALLS)
    return f"{len(plan.CALLS)} calls; tree {tree / plan.MIB:.1f} MiB, largest call {worst / plan.MIB:.1f} MiB of " \
           f"{plan.TREE_LIMIT // plan.MIB}; commands <= {max(len(c.command) for c in plan.CALLS)} chars"


def stage_image_venv(ctx) -> str:
    ctx["py312"] = venv("image-py312", find_python(PY312), IMAGE_PINS, 900)
    return sh([ctx["py312"], "-c", "import sys, numpy; from importlib.metadata import version as v; "
               "print(sys.version.split()[0], 'numpy', numpy.__version__, 'cuda-bindings', v('cuda-bindings'), "
               "'(torch: none for python 3.12 on this machine)')"], 60).strip()


def stage_carried(ctx) -> str:
    site = ctx["site"] = pathlib.Path(tempfile.mkdtemp(prefix="blink-site-"))
    sh(["bash", "scripts/gpu_check.sh", "--install-wheels", site], 120, cwd=REPO,
       env=dict(os.environ, PYTHON=str(ctx["py312"]), PIP_FIND_LINKS="", PIP_EXTRA_INDEX_URL=""))
    ctx["device_env"] = dict(os.environ, PYTHONPATH=f"{site}:{REPO}", PYTHONNOUSERSITE="1")
    code = ("import importlib, sys; from importlib.metadata import version; site = sys.argv[1]; pins = sys.argv[2:]\n"
            "for pin in pins:\n"
            "    name, want = pin.split('==')\n"
            "    got = version(name)\n"
            "    assert got == want, (pin, got)\n"
            "for m in ('gguf', 'pydantic', 'pydantic_core', 'outlines_core', 'typing_extensions'):\n"
            "    assert importlib.import_module(m).__file__.startswith(site), (m, 'not from the carried site')\n"
            "print(len(pins), 'carried wheels at their pinned versions, imported from the carried site')")
    return sh([ctx["py312"], "-c", code, site, *plan.WHEELS], 60, env=ctx["device_env"], cwd=REPO).strip()


def _device_sources() -> list[pathlib.Path]:
    out = []
    for rel in DEVICE_CODE:
        p = REPO / rel
        out += [p] if p.is_file() else sorted(q for q in p.rglob("*.py") if "__pycache__" not in q.parts)
    return out


def _guarded(tree: ast.AST) -> set[int]:
    """Line numbers of imports inside a try whose handlers catch ImportError (optional imports)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                h.type is None or any(n in ast.unparse(h.type) for n in ("ImportError", "ModuleNotFoundError",
                                                                         "Exception"))
                for h in node.handlers):
            for sub in node.body:
                lines |= {n.lineno for n in ast.walk(sub) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def third_party_imports() -> dict[str, set[str]]:
    """Top-level module -> files importing it (unguarded), outside the stdlib and the checkout."""
    found: dict[str, set[str]] = {}
    local = LOCAL_ROOTS | {p.stem for p in _device_sources()}     # test helpers imported by file name
    for path in _device_sources():
        tree = ast.parse(path.read_text(), str(path))
        guarded = _guarded(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                if node.lineno in guarded or root in sys.stdlib_module_names or root in local:
                    continue
                found.setdefault(root, set()).add(str(path.relative_to(REPO)))
    return found


def uncovered_imports() -> list[str]:
    """Third-party imports of the device's code that neither the GPU image nor a carried wheel satisfies."""
    carried = {w.split("==")[0] for w in plan.WHEELS}
    problems = []
    for root, files in sorted(third_party_imports().items()):
        dist = DIST_OF.get(root, root.replace("_", "-"))
        if dist not in plan.IMAGE_PACKAGES and dist not in carried and root not in OPTIONAL:
            problems.append(f"{root} ({dist}): not in the GPU image nor carried; imported by {sorted(files)[:3]}")
    return problems


# Every module of these packages, imported in the image's stand-in (no torch there: a module may fail on
# torch alone, which the image has). The frontend's processes start from these on the device.
IMPORT_ALL = ("shared_layout", "dpu_frontend", "gpu_backend")
IMPORT_ALL_CODE = """import importlib, json, pkgutil, sys
done, bad = [], {}
for pkg in sys.argv[1:]:
    names = [pkg] + [m.name for m in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + ".")]
    for name in names:
        try:
            importlib.import_module(name)
            done.append(name)
        except ModuleNotFoundError as e:
            if e.name != "torch" and not (e.name or "").startswith("torch."):
                bad[name] = repr(e)
        except Exception as e:
            bad[name] = repr(e)[:300]
print(json.dumps({"done": len(done), "bad": bad}))"""


def stage_imports(ctx) -> str:
    py = ctx["py312"]
    sh([py, "-m", "compileall", "-q", "-j", "2", *[REPO / r for r in DEVICE_CODE]], 300)
    problems = uncovered_imports()
    mods = [m for m in ("shared_layout", "dpu_frontend.ring_client", "dpu_frontend.transport", "dpu_frontend.app",
                        "dpu_frontend.protocol", "dpu_frontend.structured.compiler", "gpu_backend.cuda.build",
                        "gpu_backend.cuda.driver", "gpu_backend.cuda.runtime", "gpu_backend.cuda.twin",
                        "gpu_backend.cuda.probe", "gpu_backend.cuda.child_env", "gguf", "cuda.bindings.driver",
                        "pydantic", "outlines_core")]
    sh([py, "-c", f"import importlib; [importlib.import_module(m) for m in {mods!r}]"], 120, env=ctx["device_env"],
       cwd=REPO)
    res = json.loads(sh([py, "-c", IMPORT_ALL_CODE, *IMPORT_ALL], 180, env=ctx["device_env"],
                        cwd=REPO).strip().splitlines()[-1])
    problems += [f"{m} does not import with the image's packages and the carried wheels: {e}"
                 for m, e in sorted(res["bad"].items())]
    missing, n_names = driver_names_missing(py, ctx["device_env"])
    problems += [f"cuda.bindings.driver has no {n} (used by {f})" for n, f in missing]
    if problems:
        raise Failed("\n".join(problems))
    return f"{len(_device_sources())} files compile under 3.12; every third-party import is in the image or " \
           f"carried; {res['done']} modules of {'/'.join(IMPORT_ALL)} import (the rest need torch alone); " \
           f"all {n_names} cuda.bindings.driver names the code uses exist"


def driver_names_missing(py, env) -> tuple[list[tuple[str, str]], int]:
    """Every cuda.bindings.driver attribute the code names (d.cuX, d.CUx.Y, attr.CU_DEVICE_ATTRIBUTE_X)."""
    uses = {}
    for path in [*(REPO / "gpu_backend").rglob("*.py"), REPO / "bench/cuda_scheduler.py", REPO / "bench/cuda_graphs.py"]:
        text = path.read_text()
        for m in re.finditer(r"\b(?:d|driver|bindings\(\))\.((?:cu|CU)\w*)(?:\.(\w+))?", text):
            uses[m.group(1) + (f".{m.group(2)}" if m.group(2) and m.group(1)[:2] == "CU" else "")] = path.name
        for m in re.finditer(r"\battr\.(CU_DEVICE_ATTRIBUTE_\w+)", text):
            uses[f"CUdevice_attribute.{m.group(1)}"] = path.name
    code = ("import json, sys; from cuda.bindings import driver as d\n"
            "names = json.loads(sys.argv[1]); bad = []\n"
            "for n in names:\n"
            "    o = d\n"
            "    for part in n.split('.'):\n"
            "        o = getattr(o, part, None)\n"
            "        if o is None: bad.append(n); break\n"
            "print(json.dumps(bad))")
    bad = json.loads(sh([py, "-c", code, json.dumps(sorted(uses))], 60, env=env).strip().splitlines()[-1])
    return [(n, uses[n]) for n in bad], len(uses)


CHILD_CODE = ("import importlib, json, sys; mods = json.loads(sys.argv[1]); "
              "print(json.dumps({m: importlib.import_module(m).__file__ for m in mods}))")


def stage_child_env(ctx) -> str:
    mods = ["gguf", "numpy", "yaml", "aiohttp", "tokenizers", "cuda.bindings.driver", "shared_layout", "dpu_frontend",
            "gpu_backend"]
    code = ("import json, subprocess, sys\n"
            "from gpu_backend.cuda.child_env import child_env\n"
            f"code, mods = {CHILD_CODE!r}, {mods!r}\n"
            "mine = json.loads(subprocess.run([sys.executable, '-c', code, json.dumps(mods)], capture_output=True,"
            " text=True, check=True).stdout)\n"
            "child = json.loads(subprocess.run([sys.executable, '-c', code, json.dumps(mods)], env=child_env(),"
            " capture_output=True, text=True, check=True).stdout)\n"
            "bare = subprocess.run([sys.executable, '-c', 'import gguf'], env=dict(child_env(), PYTHONPATH=str("
            "__import__('gpu_backend.cuda.child_env').cuda.child_env.REPO)), capture_output=True).returncode\n"
            "assert child == mine, (child, mine)\n"
            "print(json.dumps({'same': True, 'gguf': child['gguf'], 'bare_pythonpath_rc': bare}))")
    out = json.loads(sh([ctx["py312"], "-c", code], 120, env=ctx["device_env"], cwd=REPO).strip().splitlines()[-1])
    if not out["gguf"].startswith(str(ctx["site"])) or out["bare_pythonpath_rc"] == 0:
        raise Failed(f"the carried site is not what a child sees, or the check cannot tell: {out}")
    bad = [str(p.relative_to(REPO)) for p in [*(REPO / "tests/gpu_backend/cuda").glob("*.py"),
                                              *(REPO / "tests/gpu_backend/graphs").glob("*.py"),
                                              REPO / "bench/cuda_graphs.py", REPO / "bench/cuda_scheduler.py"]
           if p.name != "test_child_env.py" and re.search(r"PYTHONPATH\s*=", p.read_text())]   # that one tests it
    if bad:
        raise Failed(f"these set PYTHONPATH for a child themselves instead of child_env(): {bad}")
    return f"{len(mods)} modules resolve alike in parent and child (gguf from the carried site); " \
           f"a bare PYTHONPATH=<checkout> would lose it"


def stage_torch_venv(ctx) -> str:
    ctx["py311"] = venv("torch-py311", find_python(PY311), TORCH_PINS, 900)
    site = ctx["site311"] = pathlib.Path(tempfile.mkdtemp(prefix="blink-site311-"))
    # the carried pins, as wheels for 3.11 (outlines-core and pydantic-core are compiled: cp312 ones refuse 3.11)
    sh([ctx["py311"], "-m", "pip", "install", "-q", "--no-deps", "--only-binary=:all:", "--target", site,
        *plan.WHEELS], 300)
    ctx["torch_env"] = dict(os.environ, PYTHONPATH=f"{site}:{REPO}", PYTHONNOUSERSITE="1")
    return sh([ctx["py311"], "-c", "import sys, torch, numpy; print(sys.version.split()[0], 'torch', torch.__version__, "
               "'numpy', numpy.__version__)"], 120).strip()


def stage_collect(ctx) -> str:
    out = sh([ctx["py311"], "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
              "tests/gpu_backend/cuda", "tests/gpu_backend/graphs"], 300, env=ctx["torch_env"], cwd=REPO)
    m = re.search(r"(\d+)/\d+ tests collected", out)
    if "error" in out.lower().split("tests collected")[-1] or not m or int(m.group(1)) < 10:
        raise Failed(out[-2000:])
    return f"{m.group(1)} gpu tests collected, no import errors"


def stage_nvcc(ctx) -> str:
    code = ("import pathlib, sys, tempfile; from gpu_backend.cuda import build; "
            "print([p.name for p in build.build_strict(pathlib.Path(tempfile.mkdtemp()))])")
    return sh([sys.executable, "-c", code], 600, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO))).strip()


def stage_twin(ctx) -> str:
    out = sh([ctx["py311"], "-m", "pytest", "-q", "-m", "not gpu", "-p", "no:cacheprovider",
              "tests/gpu_backend/cuda"], 600, env=ctx["torch_env"], cwd=REPO)
    return out.strip().splitlines()[-1]


def stage_triton(ctx) -> str:
    env = {k: v for k, v in ctx["torch_env"].items() if k != "TRITON_INTERPRET"}
    lines = []
    for dtype in ("float32", "bfloat16"):
        out = sh([ctx["py311"], "-m", "gpu_backend.graphs.triton_aot", "--dtype", dtype], 300, env=env, cwd=REPO)
        lines += out.strip().splitlines()
    # Under the interpreter the two files take ~15 min of one core on the AVX2 EPYC (Zen 1, 2026-11-28:
    # 928 s, three sampler tests 430 s of it; ~4 min on Zen 4), so they run on every core (xdist)
    tests = sh([ctx["py311"], "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(os.cpu_count() or 1),
                "tests/gpu_backend/graphs/test_triton_kernels.py", "tests/gpu_backend/graphs/test_triton_sampler.py"],
               900, env=env, cwd=REPO)
    return f"{len(lines)} kernel variants compiled for sm_90; interpreter tests: {tests.strip().splitlines()[-1]}"


def check_out_dir(out: pathlib.Path, declared: list[str]) -> list[str]:
    problems, files = [], [p for p in out.rglob("*") if p.is_file()]
    if len(files) > plan.OUT_FILES:
        problems.append(f"{len(files)} files in $OUT, over {plan.OUT_FILES}")
    for f in files:
        rel = str(f.relative_to(out))
        problems += [p for p in [plan.check_out_name(rel)] if p]
        if f.stat().st_size > plan.OUT_FILE_BYTES:
            problems.append(f"{rel}: {f.stat().st_size} bytes, over {plan.OUT_FILE_BYTES}")
        if not any(fnmatch.fnmatch(rel, d) for d in declared):
            problems.append(f"{rel}: written but not declared in the plan")
    return problems


def stage_runner(ctx) -> str:
    lines = []
    for c in plan.CALLS:
        out = pathlib.Path(tempfile.mkdtemp(prefix=f"blink-out-{c.name}-"))
        res = subprocess.run(["bash", "scripts/gpu_check.sh", "--call", c.name], capture_output=True, text=True,
                             timeout=c.budget_s, cwd=REPO,
                             env=dict(ctx["torch_env"], OUT=str(out), GPU_CHECK_DRY="1", PYTHON=str(ctx["py311"])))
        log = (out / f"{c.name}.log").read_text() if (out / f"{c.name}.log").exists() else res.stdout
        verdicts = re.findall(rf"^=== {c.name}/(\w+): (\S+)", log, re.M)
        if res.returncode != 0 or [n for n, _ in verdicts] != [s.name for s in c.stages]:
            raise Failed(f"call {c.name} (dry): rc {res.returncode}, verdicts {verdicts}\n{log[-2500:]}")
        problems = check_out_dir(out, c.out_files())
        if problems:
            raise Failed(f"call {c.name}: " + "; ".join(problems))
        lines.append(f"{c.name}: {len(c.stages)} stages, {len(list(out.iterdir()))} files")
    return "; ".join(lines)


def stage_timeout(ctx) -> str:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="blink-timeout-"))
    (tmp / "test_sleepy.py").write_text("import time\n\ndef test_quick():\n    pass\n\n"
                                        "def test_sleeps():\n    time.sleep(120)\n")
    out = tmp / "out"
    t0 = time.monotonic()
    res = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "--run-stage", "sleepy", "4", "pytest",
                          ctx["py311"], "-m", "pytest", str(tmp / "test_sleepy.py"), "-v", "-p", "no:cacheprovider",
                          f"--junitxml={out}/stage-sleepy.xml"], capture_output=True, text=True, timeout=90,
                         env=dict(ctx["torch_env"], OUT=str(out)), cwd=tmp)
    took = time.monotonic() - t0
    line = next((x for x in res.stdout.splitlines() if x.startswith("=== stage/sleepy: ")), "")
    if res.returncode == 0 or "TIMEOUT" not in line or "1 passed" not in line or took > 40:
        raise Failed(f"rc {res.returncode} after {took:.0f} s, verdict {line!r}\n{res.stdout[-1500:]}")
    return f"{line.removeprefix('=== ')} (junit written after SIGINT)"


STAGES = [("prepare", stage_prepare), ("plan", stage_plan), ("image_venv", stage_image_venv),
          ("carried", stage_carried), ("imports", stage_imports), ("child_env", stage_child_env),
          ("torch_venv", stage_torch_venv), ("collect", stage_collect), ("nvcc", stage_nvcc), ("twin", stage_twin),
          ("triton", stage_triton), ("runner", stage_runner), ("timeout", stage_timeout)]
NEEDS = {"carried": "image_venv", "imports": "carried", "child_env": "carried", "collect": "torch_venv",
         "twin": "torch_venv", "triton": "torch_venv", "runner": "torch_venv", "timeout": "torch_venv"}


def main(argv: list[str]) -> int:
    only = set(argv)             # stage names: those and what they need; none: every stage
    for name in list(only):
        while name in NEEDS:
            name = NEEDS[name]
            only.add(name)
    ctx, results, t_all = {}, [], time.monotonic()
    for name, fn in STAGES:
        if only and name not in only:
            continue
        if NEEDS.get(name) and NEEDS[name] not in [n for n, ok, _, _ in results if ok]:
            results.append((name, False, 0.0, f"not run: {NEEDS[name]} failed"))
            print(f"--- {name}: SKIPPED ({NEEDS[name]} failed)", flush=True)
            continue
        t0 = time.monotonic()
        print(f"--- {name} ...", flush=True)
        try:
            detail, ok = fn(ctx), True
        except Failed as e:
            detail, ok = str(e), False
        took = time.monotonic() - t0
        results.append((name, ok, took, detail))
        print(f"--- {name}: {'PASS' if ok else 'FAIL'} in {took:.0f} s: {detail}", flush=True)
    total = time.monotonic() - t_all
    print("\n=== rehearsal summary")
    for name, ok, took, detail in results:
        print(f"  {'PASS' if ok else 'FAIL'}  {name:<11} {took:6.0f} s  {detail.splitlines()[0][:140] if detail else ''}")
    bad = [n for n, ok, _, _ in results if not ok]
    print(f"rehearsal: {'all stages passed' if not bad else 'FAILED: ' + ', '.join(bad)} in {total:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
