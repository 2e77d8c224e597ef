"""ctypes mirror of gpu_backend/csrc/sched_types.h (and the ring's slot record).

    Python config -> SchedParams (ctypes) -> bytes copied to device memory (or
    handed to the CPU twin by pointer) -> every kernel reads it

tests/gpu_backend/cuda/test_structs.py compares every offset and size here with
what g++ computes from the header, so the two cannot drift apart.
"""
from __future__ import annotations

import ctypes

from shared_layout.layout import MAX_LOGPROBS, MAX_STOP_IDS

MAX_EOS_IDS = 8
ROW_STOPS = MAX_STOP_IDS + MAX_EOS_IDS     # csrc BLINK_ROW_STOPS (= graphs.sampler.ROW_STOPS)
TOP_LOGPROBS = MAX_LOGPROBS                # csrc BLINK_TOP_LOGPROBS
NO_SEAT = 0xFFFF_FFFF                      # csrc BLINK_NO_SEAT
BAD_WORDS = 64                             # csrc BLINK_BAD_WORDS (= graphs.sampler.BAD_WORDS)
BAD_WORD_LEN = 64                          # csrc BLINK_BAD_WORD_LEN (= graphs.sampler.BAD_WORD_LEN)
STEP_GRAPHS = 2               # instances of each step graph, launched alternately

ROW_SAMPLE, ROW_LOGPROBS, ROW_CHUNK = 0x8000_0000, 0x4000_0000, 0x3FFF_FFFF   # csrc/graph_table.h
KV_OK, KV_NO_BLOCKS, KV_TABLE_FULL, KV_NOT_OWNED, KV_BAD_ROW = 0, 1, 2, 3, 4

STEP_IDLE, STEP_PREFILL, STEP_DECODE = 0, 1, 2
REQ_FREE, REQ_WAITING, REQ_RUNNING, REQ_FINISHED = 0, 1, 2, 3
EXIT_NONE, EXIT_SHUTDOWN, EXIT_RELAUNCH, EXIT_STEP_TIMEOUT, EXIT_LAUNCH_FAILED = 0, 1, 2, 3, 4
EXIT_NAMES = {EXIT_NONE: "none", EXIT_SHUTDOWN: "shutdown", EXIT_RELAUNCH: "relaunch",
              EXIT_STEP_TIMEOUT: "step graph timed out", EXIT_LAUNCH_FAILED: "tail relaunch failed"}

u32, i32, u64, i64, ptr = ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_uint64


class _Struct(ctypes.Structure):
    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name, *_ in self._fields_}


class PolicyConfig(_Struct):
    _fields_ = [("max_batch_size", u32), ("max_prefill_tokens", u32), ("block_size", u32),
                ("num_blocks", u32), ("max_model_len", u32), ("vocab_size", u32), ("n_eos", u32),
                ("eos_ids", i32 * MAX_EOS_IDS), ("reserved", u32)]


class Req(_Struct):
    _fields_ = [("seq", u64), ("epoch", u64), ("prompt_offset", u32), ("prompt_len", u32),
                ("output_offset", u32), ("max_tokens", u32), ("flags", u32), ("n_stop", u32),
                ("stop_ids", i32 * MAX_STOP_IDS), ("generated", u32), ("num_computed", u32),
                ("num_blocks", u32), ("status", u32), ("ring_state", u32), ("abort_finish", u32),
                ("abort_error", u32), ("intake_error", u32), ("temperature", ctypes.c_float),
                ("top_p", ctypes.c_float), ("top_k", i32), ("reserved", u32), ("seed", u64),
                ("min_p", ctypes.c_float), ("presence_penalty", ctypes.c_float),
                ("frequency_penalty", ctypes.c_float), ("repetition_penalty", ctypes.c_float),
                ("min_tokens", u32), ("n_mask_stops", u32), ("mask_stops", i32 * ROW_STOPS),
                ("logprobs", u32), ("logprobs_offset", u32), ("seat", u32), ("seat_fresh", u32),
                ("extra_offset", u32), ("n_logit_bias", u32), ("n_allowed_ids", u32), ("bad_words_words", u32),
                ("automaton_words", u32), ("automaton_offset", u32), ("automaton_state", i32), ("reserved2", u32),
                ("num_cached", u32), ("cached_idle", u32), ("num_committed", u32), ("n_keys", u32),
                ("key_pos", u32), ("reserved3", u32), ("key_run", u64)]


class SchedState(_Struct):
    _fields_ = [("w_head", u32), ("w_count", u32), ("n_running", u32), ("free_blocks", u32),
                ("prev_kind", u32), ("in_flight", u32), ("step_no", u32), ("n_chunks", u32),
                ("draining", u32), ("started", u32), ("n_rows", u32), ("graph", u32),
                ("drain_deadline_ns", u64), ("last_beat_ns", u64),
                ("step_launched_ns", u64), ("plan_stamp", u32), ("scan_valid", u32), ("scan_bell", u64),
                ("scan_epoch", u64), ("scan_ns", u64), ("fast_checked", u32), ("fast_plan_off", u32),
                ("commit_checked", u32), ("evict_checked", u32), ("admit_checked", u32), ("reserved_state", u32)]


CHECK_ALWAYS = 0xFFFF_FFFF   # SchedParams.fast_plan_checks: check every fast plan (the twin in the tests)
SCRATCH_LISTS = 25    # csrc/sched_loop.h BLINK_SCRATCH_LISTS: plan_scratch's lists of max_batch_size entries

COUNTERS = ("heartbeat", "iterations", "windows", "launches", "launch_retries", "steps_prefill",
            "steps_decode", "tokens", "claimed", "completed", "preempted", "scan_ns", "scans", "wait_ns",
            "publish_ns", "plan_ns", "launch_ns", "fallback_steps", "prefix_hit_tokens", "prefix_miss_tokens",
            "prefix_hit_blocks", "prefix_miss_blocks", "reap_ns", "policy_ns", "apply_ns", "rows_ns", "fast_plans",
            "fast_plan_mismatches", "fill_blocks", "par_commits", "commit_ns",
            "fill_evictions", "fast_admits", "pub_keys_ns")


class SchedControl(_Struct):
    _fields_ = [("stop", u32), ("abort", u32), ("running", u32), ("exit_code", u32),
                *[(name, u64) for name in COUNTERS], ("last_launch_error", i32),
                ("max_window_launches", u32)]


POLICY_FCFS, POLICY_PRIORITY, POLICY_LVF = 0, 1, 2     # csrc BLINK_POLICY_* (= scheduler.policy.SchedPolicy)


class SchedRules(_Struct):
    """csrc/sched_types.h blink_sched_rules_t: PolicyConfig's policy fields and the clock."""
    _fields_ = [("policy", u32), ("lvf_alpha_milli", u32), ("lvf_beta_b_milli", i32), ("lvf_beta_f_milli", i32),
                ("lvf_xfer_blocks", u32), ("reserved", u32), ("now_us", i64)]


class ReqTime(_Struct):
    """csrc/sched_types.h blink_req_time_t: what rule 0 reads of a request."""
    _fields_ = [("id", u32), ("priority", i32), ("arrival_us", i64), ("last_us", i64), ("run_us", i64),
                ("ttft_slo_us", i64), ("tbt_slo_us", i64)]


class PKV(_Struct):
    """csrc/kv_alloc.h blink_pkv_t: the prefix-caching allocator's state."""
    _fields_ = [("free_stack", ptr), ("refs", ptr), ("key", ptr), ("has_key", ptr), ("lru_prev", ptr),
                ("lru_next", ptr), ("table_key", ptr), ("table_block", ptr), ("num_blocks", u32), ("table_cap", u32),
                ("never_cached", u32), ("evictable", u32), ("lru_head", u32), ("lru_tail", u32),
                ("extra_refs", u32), ("cached", u32), ("evictions", u32), ("reserved", u32)]


class KV(_Struct):
    """csrc/kv_alloc.h blink_kv_t."""
    _fields_ = [("free_stack", ptr), ("owner", ptr), ("tables", ptr), ("num_blocks", u32), ("max_blocks", u32),
                ("rows", u32), ("reserved", u32)]


class GraphLut(_Struct):
    """csrc/graph_table.h blink_graph_lut_t: one kind's dense lookup table."""
    _fields_ = [("ids", ptr), ("max_rows", u32), ("n_len", u32), ("n_ctx", u32), ("len_granularity", u32),
                ("ctx_granularity", u32), ("fallback", u32)]


class GraphTable(_Struct):
    """csrc/graph_table.h blink_graph_table_t. shapes == 0: one stand-in graph (the echo), no rows."""
    _fields_ = [("execs", ptr), ("shapes", ptr), ("prefill", GraphLut), ("decode", GraphLut), ("n_graphs", u32),
                ("split_len", u32)]


class StepIO(_Struct):
    """csrc/model_step.h blink_step_io_t: the static tensors of the model step graphs."""
    _fields_ = [("input_ids", ptr), ("positions", ptr), ("slot_mapping", ptr), ("block_tables", ptr),
                ("q_lens", ptr), ("temperature", ptr), ("top_p", ptr), ("top_k", ptr), ("seeds", ptr),
                ("token_index", ptr), ("tokens", ptr), ("min_p", ptr), ("presence", ptr), ("frequency", ptr),
                ("repetition", ptr), ("min_tokens", ptr), ("stop_ids", ptr), ("seat", ptr), ("lp_token", ptr),
                ("lp_rank", ptr), ("lp_top_ids", ptr), ("lp_top_vals", ptr), ("seat_bias", ptr), ("seat_counts", ptr),
                ("seat_prompt_mask", ptr), ("seat_recent", ptr), ("seat_bad_prefix", ptr), ("seat_bad_len", ptr),
                ("seat_bad_last", ptr), ("automaton_on", ptr), ("automaton_allowed", ptr), ("lp_want", ptr), ("block_size", u32), ("sink_block", u32), ("sink_seat", u32), ("vocab", u32)]


class SchedParams(_Struct):
    _fields_ = [("ring", ptr), ("slot_count", u64), ("prompt_arena_tokens", u64), ("output_arena_tokens", u64),
                ("slots_offset", u64), ("prompt_arena_offset", u64), ("output_arena_offset", u64),
                ("logprob_arena_offset", u64), ("logprob_arena_words", u64), ("reqs", ptr), ("waiting", ptr), ("running", ptr), ("arrivals", ptr), ("chunk_slot", ptr),
                ("chunk_start", ptr), ("chunk_len", ptr), ("chunk_sample", ptr), ("step_tokens", ptr),
                ("done", ptr), ("plan_scratch", ptr), ("row_slot", ptr), ("row_start", ptr), ("row_len", ptr),
                ("row_flags", ptr), ("kv_free_stack", ptr), ("kv_owner", ptr), ("kv_tables", ptr), ("seat_owner", ptr),
                ("state", ptr), ("control", ptr), ("stats", ptr),
                ("graphs", GraphTable), ("policy", PolicyConfig), ("window_limit", u32),
                ("n_seats", u32), ("idle_sleep_ns", u32), ("launch_retry_limit", u32),
                ("kv_max_blocks", u32), ("full_scan_us", u32),
                ("beat_interval_ns", u64), ("grace_ns", u64), ("step_timeout_ns", u64),
                ("clock_offset_ns", i64), ("rules", SchedRules), ("times", ptr), ("plan_w_out", ptr),
                ("plan_r_out", ptr), ("plan_victims", ptr), ("plan_lid", ptr), ("plan_lkey", ptr), ("pkv", ptr),
                ("pkv_refs", ptr), ("pkv_key", ptr), ("pkv_has_key", ptr), ("pkv_lru_prev", ptr),
                ("pkv_lru_next", ptr), ("pkv_table_key", ptr), ("pkv_table_block", ptr), ("pkv_claimed", ptr),
                ("kv_keys", ptr), ("pkv_table_cap", u32), ("prefix_caching", u32), ("ttft_slo_us", i64),
                ("tbt_slo_us", i64), ("fast_plan", u32), ("fast_plan_checks", u32), ("shared_state", u32),
                ("reserved_params0", u32), ("home", ptr)]


C_NAMES = {PolicyConfig: "blink_policy_config_t", Req: "blink_req_t", SchedState: "blink_sched_state_t",
           SchedControl: "blink_sched_control_t", SchedParams: "blink_sched_params_t", KV: "blink_kv_t",
           SchedRules: "blink_sched_rules_t", ReqTime: "blink_req_time_t", PKV: "blink_pkv_t",
           GraphLut: "blink_graph_lut_t", GraphTable: "blink_graph_table_t", StepIO: "blink_step_io_t"}


def pkv_table_cap(num_blocks: int) -> int:
    """The prefix cache's hash table size: a power of two >= 2 * num_blocks."""
    cap = 2
    while cap < 2 * num_blocks:
        cap *= 2
    return cap


def buffer_sizes(slot_count: int, max_batch_size: int, *, num_blocks: int, max_blocks: int,
                 max_rows: int) -> dict[str, int]:
    """Bytes of each device buffer the scheduler needs (pointer fields of SchedParams).

    num_blocks: the KV pool; max_blocks: blocks of one slot's table; max_rows: rows of the
    largest step graph (0 for the stand-in echo, which reads no rows)."""
    rows = max(1, max_rows)
    cap = pkv_table_cap(num_blocks)
    both = slot_count + max_batch_size
    return {"times": slot_count * ctypes.sizeof(ReqTime), "plan_w_out": 4 * slot_count,
            "plan_r_out": 4 * max_batch_size, "plan_victims": 4 * max_batch_size, "plan_lid": 4 * both,
            "plan_lkey": 8 * both, "pkv": ctypes.sizeof(PKV), "pkv_refs": 4 * num_blocks, "pkv_key": 8 * num_blocks,
            "pkv_has_key": 4 * num_blocks, "pkv_lru_prev": 4 * num_blocks, "pkv_lru_next": 4 * num_blocks,
            "pkv_table_key": 8 * cap, "pkv_table_block": 4 * cap, "pkv_claimed": 4 * num_blocks,
            "kv_keys": 8 * slot_count * max_blocks,
            "reqs": slot_count * ctypes.sizeof(Req), "waiting": 4 * slot_count, "running": 4 * max_batch_size,
            "arrivals": 4 * slot_count, "chunk_slot": 4 * max_batch_size, "chunk_start": 4 * max_batch_size,
            "chunk_len": 4 * max_batch_size, "chunk_sample": 4 * max_batch_size,
            "step_tokens": 4 * max_batch_size, "done": 8, "plan_scratch": 4 * SCRATCH_LISTS * max_batch_size,
            "row_slot": 4 * rows, "row_start": 4 * rows, "row_len": 4 * rows, "row_flags": 4 * rows,
            "kv_free_stack": 4 * num_blocks, "kv_owner": 4 * num_blocks,
            "kv_tables": 4 * slot_count * max_blocks, "seat_owner": 4 * max(1, max_batch_size),
            "state": ctypes.sizeof(SchedState), "stats": ctypes.sizeof(SchedControl)}
