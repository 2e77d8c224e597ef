"""The scheduler on the CPU: the C++ of gpu_backend/csrc built with g++ and
called through ctypes. Two uses:

    plan_step(PolicyInput, PolicyConfig) -> StepPlan   the device's planner, for the
        diff test against gpu_backend/scheduler/policy.py (same signature as policy.plan_step)
    Automaton(words, vocab): ok / allowed / advance   csrc/automaton.h (structured outputs),
        for the diff test against shared_layout.automaton and logits_processors
    TwinScheduler(ring, SchedulerConfig).start()         the whole persistent loop
        (scan, claim, intake, publish, plan, window relaunch, shutdown) on host
        threads over a real ring, with the echo step run inline; the kernel
        runs the same source

Needs g++ (build.build_host_twin); raises build.BuildError without one.
"""
from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

from shared_layout import Ring
from shared_layout.layout import SLOT_DTYPE

from ..scheduler import policy as py_policy
from . import build, structs
from .config import SchedulerConfig

LAUNCH_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32)


@functools.cache
def lib(defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The twin library (`defines`: a test variant's preprocessor symbols, build.build_host_twin)."""
    so = ctypes.CDLL(str(build.build_host_twin(defines=defines)))
    so.blink_twin_run.restype = ctypes.c_uint32
    so.blink_twin_run.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
    so.blink_plan.restype = None
    so.blink_twin_ring_rmw.restype = ctypes.c_uint64
    so.blink_device_launch_cap.restype = ctypes.c_uint32
    so.blink_max_window.restype = ctypes.c_uint32
    so.blink_scratch_lists.restype = ctypes.c_uint32
    so.blink_finish.restype = ctypes.c_uint32
    so.blink_intake.restype = ctypes.c_uint32
    so.blink_intake.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64,
                                ctypes.c_void_p]
    so.blink_unsupported.restype = ctypes.c_uint32
    so.blink_unsupported.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    so.blink_extra_check.restype = ctypes.c_int
    so.blink_extra_check.argtypes = [ctypes.c_void_p] + [ctypes.c_uint32] * 4
    so.blink_automaton_check_c.restype = ctypes.c_int
    so.blink_automaton_check_c.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32]
    so.blink_automaton_mask_c.restype = None
    so.blink_automaton_mask_c.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_uint32,
                                          ctypes.c_uint32, ctypes.c_void_p]
    so.blink_automaton_advance_c.restype = ctypes.c_int32
    so.blink_automaton_advance_c.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]
    vp, u32 = ctypes.c_void_p, ctypes.c_uint32
    for name, args in (("blink_kv_init_c", [vp, vp]), ("blink_kv_alloc_c", [vp, vp, u32, u32, u32]),
                       ("blink_kv_free_c", [vp, vp, u32, u32]), ("blink_kv_check_c", [vp, u32]),
                       ("blink_graph_fits_c", [vp, u32, u32, u32, u32, u32])):
        getattr(so, name).restype = ctypes.c_int
        getattr(so, name).argtypes = args
    so.blink_graph_lookup_c.restype = u32
    so.blink_graph_lookup_c.argtypes = [vp, u32, u32, u32, u32]
    so.blink_step_key_c.restype = None
    so.blink_step_key_c.argtypes = [vp, u32, vp, vp, u32, vp]
    so.blink_fill_rows_c.restype = u32
    so.blink_fill_rows_c.argtypes = [u32, vp, vp, vp, vp, u32, vp, vp, vp, vp]
    so.blink_twin_stage.restype = None
    so.blink_twin_stage.argtypes = [vp, vp, u32, u32, u32]
    so.blink_twin_finish.restype = None
    so.blink_twin_finish.argtypes = [vp, vp]
    so.blink_struct_offset.restype = ctypes.c_long
    so.blink_struct_offset.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    so.blink_struct_size.restype = ctypes.c_long
    so.blink_struct_size.argtypes = [ctypes.c_char_p]
    return so


def _u32(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.uint32))


SchedRules, ReqTime = structs.SchedRules, structs.ReqTime   # sched_types.h's blink_sched_rules_t, blink_req_time_t


def plan_step(inp: py_policy.PolicyInput, cfg: py_policy.PolicyConfig) -> py_policy.StepPlan:
    """policy.plan_step computed by the device's C++ planner (blink_plan_step for FCFS,
    blink_plan_step_policy otherwise)."""
    ids = [w.id for w in inp.waiting] + [r.id for r in inp.running]
    reqs = (structs.Req * max(1, len(ids)))()
    times = (ReqTime * max(1, len(ids)))()
    for i, w in enumerate(inp.waiting):
        reqs[i].prompt_len = w.num_tokens
        reqs[i].num_cached, reqs[i].cached_idle = w.num_cached, w.cached_idle
        reqs[i].status = structs.REQ_WAITING
        times[i] = ReqTime(w.id, w.priority, w.arrival_us, w.last_us, 0, w.ttft_slo_us, w.tbt_slo_us)
    for j, r in enumerate(inp.running):
        q = reqs[len(inp.waiting) + j]
        q.prompt_len, q.num_computed, q.num_blocks = r.num_tokens, r.num_computed, r.num_blocks
        q.status = structs.REQ_RUNNING
        times[len(inp.waiting) + j] = ReqTime(r.id, r.priority, r.arrival_us, -1, r.run_us, 0, 0)
    rules = None
    if cfg.policy != py_policy.SchedPolicy.FCFS:
        rules = ctypes.byref(SchedRules(int(cfg.policy), cfg.lvf_alpha_milli, cfg.lvf_beta_b_milli,
                                        cfg.lvf_beta_f_milli, cfg.lvf_xfer_blocks, 0, inp.now_us))
    pc = structs.PolicyConfig(max_batch_size=cfg.max_batch_size, max_prefill_tokens=cfg.max_prefill_tokens,
                              block_size=cfg.block_size)
    cap = max(1, cfg.max_batch_size + len(inp.waiting) + len(inp.running))   # room even for off-invariant inputs
    waiting = _u32(range(len(inp.waiting)))
    running = _u32(range(len(inp.waiting), len(ids)))
    counts = np.zeros(6, np.uint32)
    lists = np.zeros(7 * cap, np.uint32)
    vp = ctypes.c_void_p
    lib().blink_plan(ctypes.byref(pc), ctypes.byref(reqs), vp(waiting.ctypes.data), ctypes.c_uint32(len(waiting)),
                     vp(running.ctypes.data), ctypes.c_uint32(len(running)), ctypes.c_int64(inp.free_blocks),
                     ctypes.c_uint32(int(inp.prev_kind)), vp(counts.ctypes.data), vp(lists.ctypes.data),
                     ctypes.c_uint32(cap), rules, ctypes.byref(times))
    kind, n_pre, n_dec, n_preempt, n_adm, n_new = (int(c) for c in counts)
    col = [lists[k * cap:(k + 1) * cap] for k in range(7)]
    name = lambda h: ids[int(h)]   # noqa: E731  index -> request id
    return py_policy.StepPlan(
        py_policy.StepKind(kind),
        prefill=tuple((name(col[0][i]), int(col[1][i])) for i in range(n_pre)),
        decode=tuple(name(h) for h in col[2][:n_dec]),
        preempted=tuple(name(h) for h in col[3][:n_preempt]),
        admitted=tuple(name(h) for h in col[4][:n_adm]),
        new_blocks=tuple((name(col[5][i]), int(col[6][i])) for i in range(n_new)))


def finish_reason(cfg: SchedulerConfig, req: structs.Req, token: int) -> int:
    """The device's finish rule for a request whose `generated` already counts `token`."""
    pc = cfg.policy()
    return int(lib().blink_finish(ctypes.byref(pc), ctypes.byref(req), ctypes.c_int32(token)))


def intake_check(cfg: SchedulerConfig, geom, frontend_epoch: int, record: np.ndarray) -> tuple[int, int]:
    """(FinishReason, ErrorCode) the device's intake gives a slot record (before token ids)."""
    rec = np.ascontiguousarray(record, dtype=SLOT_DTYPE)
    pc = cfg.policy()
    code = int(lib().blink_intake(ctypes.byref(pc), geom.prompt_arena_tokens, geom.output_arena_tokens,
                                  geom.logprob_arena_words, frontend_epoch, rec.ctypes.data))
    return code >> 16, code & 0xFFFF


def device_unsupported(record: np.ndarray, n_seats: int) -> tuple[int, int]:
    """(FinishReason, ErrorCode) of the persistent scheduler's refusal of a slot record
    (blink_device_unsupported: sampling its graphs cannot serve); (0, 0): served."""
    rec = np.ascontiguousarray(record, dtype=SLOT_DTYPE)
    code = int(lib().blink_unsupported(rec.ctypes.data, n_seats))
    return code >> 16, code & 0xFFFF


def extra_ok(words: np.ndarray, vocab: int, n_logit_bias: int, n_allowed_ids: int, bad_words_words: int) -> bool:
    """The device intake's check of a slot's sampling data (blink_extra_ok)."""
    w = np.ascontiguousarray(words, "<i4")
    return bool(lib().blink_extra_check(w.ctypes.data if w.size else None, vocab, n_logit_bias, n_allowed_ids,
                                        bad_words_words))


class Automaton:
    """csrc/automaton.h over ring words in host memory: what the device's intake, staging and
    publish do with a structured output's token automaton (the diff test's side of the device)."""

    def __init__(self, words, vocab: int):
        self.words = np.ascontiguousarray(np.asarray(words), "<i4")
        self.vocab = vocab

    def ok(self) -> bool:
        """The intake's checks (header, every state): False ends the request INVALID_REQUEST."""
        return bool(lib().blink_automaton_check_c(self.words.ctypes.data, self.words.size, self.vocab))

    def allowed(self, state: int, stops=()) -> np.ndarray:
        """[vocab] bool: the staged mask at `state` (-1: the initial state) with these stop ids."""
        out = np.zeros(self.vocab, np.uint8)
        st = np.ascontiguousarray(np.asarray(stops, np.int32))
        lib().blink_automaton_mask_c(self.words.ctypes.data, state, st.ctypes.data if st.size else None, st.size,
                                     self.vocab, out.ctypes.data)
        return out.astype(bool)

    def advance(self, state: int, token: int) -> int:
        """The state the publish phase moves to after `token` (-1: from the initial state)."""
        return int(lib().blink_automaton_advance_c(self.words.ctypes.data, state, token))


class TwinScheduler:
    """The persistent scheduler's loop on host threads over `ring` (held in memory we can address)."""

    def __init__(self, ring: Ring, config: SchedulerConfig, threads: int = 4, launch_cb=None,
                 buffers: dict[str, int] | None = None, graphs: structs.GraphTable | None = None,
                 max_rows: int = 0, check_plans: bool = True, defines: tuple[str, ...] = ()):
        """`buffers`: addresses of zeroed host memory for every config.buffer_sizes entry (e.g. pinned
        memory a GPU also maps, for the host-driven baseline); numpy arrays when None. `graphs`:
        the step graphs' tables (host memory) and `max_rows` their largest row count, for a
        `launch_cb` that runs model graphs (gpu_backend/graphs/cpu_graphs.py); None: the echo.
        `check_plans`: run the full planner and the reap's walk beside every fast plan and survey
        reap (params.fast_plan_checks: always; the device checks its first config.fast_plan_checks)
        and count any disagreement (stats.fast_plan_mismatches); off (0) where the twin is a timed
        baseline. `defines`: run a test variant of the library (lib(defines))."""
        self.ring, self.config, self.threads, self.defines = ring, config, threads, defines
        sizes = config.buffer_sizes(ring.geom.slot_count, max_rows)
        if buffers is None:
            self._buffers = {name: np.zeros(max(8, n) // 8 + 1, np.uint64) for name, n in sizes.items()}
        else:
            self._buffers = {name: np.ctypeslib.as_array((ctypes.c_uint64 * -(-n // 8)).from_address(buffers[name]))
                             for name, n in sizes.items()}
        self.control = structs.SchedControl()
        ring_addr = np.frombuffer(ring.buf, np.uint8).ctypes.data
        self.params = config.params(ring.geom, ring_addr, {k: v.ctypes.data for k, v in self._buffers.items()},
                                    ctypes.addressof(self.control), graphs)
        self.params.fast_plan_checks = structs.CHECK_ALWAYS if check_plans else 0
        self._cb = LAUNCH_CB(launch_cb) if launch_cb is not None else None
        self._thread: threading.Thread | None = None
        self.exit_code: int | None = None

    def buffer(self, name: str, dtype=np.uint32) -> np.ndarray:
        return self._buffers[name].view(dtype)

    @property
    def state(self) -> structs.SchedState:
        return structs.SchedState.from_address(self._buffers["state"].ctypes.data)

    @property
    def params_addr(self) -> int:
        return ctypes.addressof(self.params)

    def kv(self) -> structs.KV:
        """The KV allocator's view (kv_alloc.h) of this scheduler's buffers."""
        return structs.KV(free_stack=self._buffers["kv_free_stack"].ctypes.data,
                          owner=self._buffers["kv_owner"].ctypes.data, tables=self._buffers["kv_tables"].ctypes.data,
                          num_blocks=self.config.kv_blocks, max_blocks=self.config.kv_max_blocks,
                          rows=self.ring.geom.slot_count)

    @property
    def stats(self) -> structs.SchedControl:
        return structs.SchedControl.from_address(self._buffers["stats"].ctypes.data)

    def run(self) -> int:
        """Serve in this thread until shutdown; returns the exit code (structs.EXIT_*)."""
        cb = ctypes.cast(self._cb, ctypes.c_void_p) if self._cb is not None else None
        self.exit_code = int(lib(self.defines).blink_twin_run(ctypes.addressof(self.params), self.threads, cb, None))
        return self.exit_code

    def start(self) -> "TwinScheduler":
        self._thread = threading.Thread(target=self.run, name="blink-twin-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self, abort: bool = False) -> None:
        """Ask for a drain (stop claiming, finish within the grace period) or an abort."""
        if abort:
            self.control.abort = 1
        self.control.stop = 1

    def join(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True


class KVAllocator:
    """csrc/kv_alloc.h on the CPU over numpy arrays: the device allocator with
    BlockAllocator's interface, for the diff test against gpu_backend/scheduler/kv_cache.py."""

    def __init__(self, num_blocks: int, rows: int, max_blocks: int):
        self.stack = np.zeros(max(1, num_blocks), np.uint32)          # [num_blocks]
        self.owner = np.zeros(max(1, num_blocks), np.uint32)          # [num_blocks]
        self.tables = np.zeros((rows, max_blocks), np.uint32)         # [rows, max_blocks]
        self.held = np.zeros(rows, np.uint32)                          # [rows] blocks in each table
        self.kv = structs.KV(free_stack=self.stack.ctypes.data, owner=self.owner.ctypes.data,
                             tables=self.tables.ctypes.data, num_blocks=num_blocks, max_blocks=max_blocks, rows=rows)
        self._free = ctypes.c_uint32(0)
        lib().blink_kv_init_c(ctypes.byref(self.kv), ctypes.byref(self._free))

    @property
    def free_count(self) -> int:
        return self._free.value

    def allocate(self, row: int, n: int) -> int:
        """Append n blocks to row's table; the kv_alloc.h status (structs.KV_*)."""
        held = int(self.held[row]) if 0 <= row < len(self.held) else 0
        rc = lib().blink_kv_alloc_c(ctypes.byref(self.kv), ctypes.byref(self._free), row, held, n)
        if rc == structs.KV_OK:
            self.held[row] += n
        return rc

    def free(self, row: int) -> int:
        rc = lib().blink_kv_free_c(ctypes.byref(self.kv), ctypes.byref(self._free), row, int(self.held[row]))
        if rc == structs.KV_OK:
            self.held[row] = 0
        return rc

    def blocks(self, row: int) -> list[int]:
        return self.tables[row, :int(self.held[row])].tolist()

    def check(self) -> int:
        return int(lib().blink_kv_check_c(ctypes.byref(self.kv), self._free.value))
