"""SchedulerConfig: the persistent scheduler's knobs, and the parameter block
(structs.SchedParams) they become for a given ring and buffer set.

    ExecutorOptions (daemon flags) -> SchedulerConfig (+ scheduling_fields(options): the
    --scheduling-policy, prefix caching and default SLOs) -> params(ring geometry, buffer
    addresses, graph table) -> SchedParams -> device memory (runtime.py) or the CPU twin
"""
from __future__ import annotations

import dataclasses
import os

from shared_layout import RingGeometry

from . import structs

DEVICE_LAUNCH_LIMIT = 120     # fire-and-forget launches one graph execution may make (CUDA guide)
LAUNCH_HEADROOM = 20          # attempts the last step of a window may still make (retries of refused launches)
MAX_WINDOW = DEVICE_LAUNCH_LIMIT - LAUNCH_HEADROOM   # sched_types.h BLINK_MAX_WINDOW
# An instance rolls over (tail-launches its successor) after 100 launch attempts: 20 below the
# cap, so a step begun at attempt 99 may be refused and retried 20 times before the runtime's
# own limit; a roll-over costs one tail launch (a few us) per 100 steps.
DEFAULT_WINDOW = MAX_WINDOW
FAST_PLAN_ENV = "BLINK_SCHED_FAST_PLAN"   # 0: every step planned by the full walks (the survey off)
SHARED_STATE_ENV = "BLINK_SCHED_SHARED_STATE"   # 0: an instance's params, state, stats, pkv in device memory


def _fast_plan_default() -> bool:
    return os.environ.get(FAST_PLAN_ENV, "1").strip() != "0"


def _shared_state_default() -> bool:
    return os.environ.get(SHARED_STATE_ENV, "1").strip() != "0"


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 256
    max_prefill_tokens: int = 1 << 20
    block_size: int = 16
    num_blocks: int = 0                 # 0: room for a full context in every seat (no preemption)
    max_model_len: int = 8192
    vocab_size: int = 49152
    eos_ids: tuple[int, ...] = ()       # the stand-in (null model) has none
    window_limit: int = DEFAULT_WINDOW
    idle_sleep_ns: int = 2000           # back-off when a scan found nothing and no step runs
    # The slot scan runs when the frontend doorbell or epoch moved, and at least every full_scan_us
    # (a safety net for a writer that does not ring); 0: every iteration, the doorbell unread.
    full_scan_us: int = 1000
    launch_retry_limit: int = 1 << 20
    beat_interval_s: float = 0.01
    grace_s: float = 2.0
    step_timeout_s: float = 30.0
    scheduling_policy: str = "fcfs"     # the daemon's --scheduling-policy: fcfs | priority | lvf (policy.py)
    prefix_caching: bool = True         # admission takes cached prefix blocks; full blocks are committed
    # Steady decode steps (FCFS, every running request decoding) planned, and the reap done, from the
    # block's parallel survey instead of one thread's walks of the running list; False (or
    # BLINK_SCHED_FAST_PLAN=0): the full walks, the A/B of bench.cuda_scheduler. The first
    # fast_plan_checks fast plans run the full walks beside them; a disagreement is counted
    # (fast_plan_mismatches) and turns the survey off for good: the scheduler heals itself.
    fast_plan: bool = dataclasses.field(default_factory=_fast_plan_default)
    fast_plan_checks: int = 32
    # Each instance copies its parameter block, its state, counters and the prefix-cache allocator's
    # scalars into the block's shared memory and works there, writing state back before each launch
    # (the step graph reads it) and all of them at each beat and at its exit: thread 0's walk between
    # two steps is a chain of dependent loads, and a counter's `+= 1` is a load after a store, each an
    # L2 round trip (~150 ns) once a fence has invalidated L1. On by default since the H200 measured
    # it: 1.12-1.36x shorter makespans in three runs (bench/results/2026-11-27-h200-gpu-check-4);
    # BLINK_SCHED_SHARED_STATE=0 keeps them in device memory (blink_scheduler).
    shared_state: bool = dataclasses.field(default_factory=_shared_state_default)
    lvf_alpha_milli: int = 3000         # policy.PolicyConfig's LVF weights
    lvf_beta_b_milli: int = 0
    lvf_beta_f_milli: int = 500
    lvf_xfer_blocks: int = 2400
    ttft_slo_ms: int = 5000             # a request's targets when its slot says 0 (intake.IntakeConfig's)
    tbt_slo_ms: int = 100

    def __post_init__(self):
        for name in ("max_batch_size", "max_prefill_tokens", "block_size", "max_model_len", "vocab_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not 1 <= self.window_limit <= MAX_WINDOW:
            raise ValueError(f"window_limit must be in 1..{MAX_WINDOW} (the device's cap of {DEVICE_LAUNCH_LIMIT} "
                             f"launches less {LAUNCH_HEADROOM} for retries), got {self.window_limit}")
        if not isinstance(self.full_scan_us, int) or not 0 <= self.full_scan_us < 1 << 32:
            raise ValueError(f"full_scan_us must be an integer in 0..2**32-1, got {self.full_scan_us!r}")
        if not isinstance(self.fast_plan_checks, int) or not 0 <= self.fast_plan_checks < 1 << 32:
            raise ValueError(f"fast_plan_checks must be an integer in 0..2**32-1, got {self.fast_plan_checks!r}")
        if str(self.scheduling_policy).upper() not in ("FCFS", "PRIORITY", "LVF"):
            raise ValueError(f"scheduling_policy must be fcfs, priority or lvf, got {self.scheduling_policy!r}")
        if len(self.eos_ids) > structs.MAX_EOS_IDS:
            raise ValueError(f"at most {structs.MAX_EOS_IDS} eos ids, got {len(self.eos_ids)}")
        if self.kv_blocks * self.block_size < self.max_model_len:
            raise ValueError(f"KV pool of {self.kv_blocks} x {self.block_size} tokens cannot hold one "
                             f"{self.max_model_len}-token context")

    @property
    def kv_max_blocks(self) -> int:
        """Blocks of one slot's table: one max_model_len context."""
        return -(-self.max_model_len // self.block_size)

    def buffer_sizes(self, slot_count: int, max_rows: int = 0) -> dict[str, int]:
        """Bytes of each scheduler buffer for a ring of `slot_count` slots and step graphs of at
        most `max_rows` rows (0: the stand-in echo)."""
        return structs.buffer_sizes(slot_count, self.max_batch_size, num_blocks=self.kv_blocks,
                                    max_blocks=self.kv_max_blocks, max_rows=max_rows)

    @property
    def kv_blocks(self) -> int:
        if self.num_blocks:
            return self.num_blocks
        return self.max_batch_size * -(-self.max_model_len // self.block_size)

    def policy(self) -> structs.PolicyConfig:
        pc = structs.PolicyConfig(max_batch_size=self.max_batch_size, max_prefill_tokens=self.max_prefill_tokens,
                                  block_size=self.block_size, num_blocks=self.kv_blocks,
                                  max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                                  n_eos=len(self.eos_ids))
        for i, t in enumerate(self.eos_ids):
            pc.eos_ids[i] = t
        return pc

    def rules(self) -> structs.SchedRules:
        """blink_sched_rules_t: the policy and its LVF weights (the device sets now_us per plan)."""
        code = {"FCFS": structs.POLICY_FCFS, "PRIORITY": structs.POLICY_PRIORITY,
                "LVF": structs.POLICY_LVF}[str(self.scheduling_policy).upper()]
        return structs.SchedRules(policy=code, lvf_alpha_milli=self.lvf_alpha_milli,
                                  lvf_beta_b_milli=self.lvf_beta_b_milli, lvf_beta_f_milli=self.lvf_beta_f_milli,
                                  lvf_xfer_blocks=self.lvf_xfer_blocks)

    def params(self, geom: RingGeometry, ring_addr: int, buffers: dict[str, int], control_addr: int,
               graphs: structs.GraphTable | None = None, clock_offset_ns: int = 0) -> structs.SchedParams:
        """The parameter block for a ring at `ring_addr` and buffers at the given addresses
        (keys of buffer_sizes), as the code that reads it addresses them. `graphs`: the step
        graphs (None: one stand-in graph whose launches a twin's callback handles)."""
        p = structs.SchedParams(
            ring=ring_addr, slot_count=geom.slot_count, prompt_arena_tokens=geom.prompt_arena_tokens,
            output_arena_tokens=geom.output_arena_tokens, slots_offset=geom.slots_offset,
            prompt_arena_offset=geom.prompt_arena_offset, output_arena_offset=geom.output_arena_offset,
            logprob_arena_offset=geom.logprob_arena_offset, logprob_arena_words=geom.logprob_arena_words,
            control=control_addr, policy=self.policy(), window_limit=self.window_limit,
            idle_sleep_ns=self.idle_sleep_ns, full_scan_us=self.full_scan_us,
            launch_retry_limit=self.launch_retry_limit, beat_interval_ns=int(self.beat_interval_s * 1e9),
            grace_ns=int(self.grace_s * 1e9), step_timeout_ns=int(self.step_timeout_s * 1e9),
            clock_offset_ns=clock_offset_ns, kv_max_blocks=self.kv_max_blocks, rules=self.rules(),
            pkv_table_cap=structs.pkv_table_cap(self.kv_blocks), prefix_caching=int(self.prefix_caching),
            ttft_slo_us=self.ttft_slo_ms * 1000, tbt_slo_us=self.tbt_slo_ms * 1000, fast_plan=int(self.fast_plan),
            fast_plan_checks=self.fast_plan_checks, shared_state=int(self.shared_state))
        for name, addr in buffers.items():
            setattr(p, name, addr)
        p.graphs = graphs if graphs is not None else structs.GraphTable(n_graphs=1)
        # the model graphs hold one sampler seat per running request (graphs/plan.StaticSizes.seats);
        # the echo stand-in none, and its intake refuses what would need one
        p.n_seats = self.max_batch_size if p.graphs.shapes else 0
        return p


def scheduling_fields(options) -> dict:
    """SchedulerConfig's fields that the daemon's ExecutorOptions set beyond the pool and batch
    shape: `SchedulerConfig(..., **scheduling_fields(options))` runs the device loop under the
    policy, prefix caching and default SLOs the daemon was started with."""
    return dict(scheduling_policy=options.scheduling_policy, prefix_caching=bool(options.prefix_caching),
                ttft_slo_ms=int(options.ttft_slo_ms), tbt_slo_ms=int(options.tbt_slo_ms))
