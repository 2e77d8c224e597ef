"""The scheduler: admission, the queues, the batching policy, preemption and the KV blocks.

    ring slot -> intake.Intake (claim, validate) -> sequence.Sequence
      -> scheduler.Scheduler (waiting queue -> policy.plan_step -> preempt, admit,
         kv_cache.BlockAllocator blocks) -> StepBatch -> the engine's Runner
    policy_sim: the policy over synthetic workloads, recorded as Scenarios for the
      device twin (csrc/sched_policy.h, csrc/kv_alloc.h)

The interface the executors share: the engine (CPU, null and CUDA host-loop
executors) drives `Scheduler` and hands its `StepBatch` to a Runner; the CUDA
persistent executor runs the C++ twins of policy.py and kv_cache.py on the
device, diff-tested against them. Integer-only and torch-free, so the policy
and the allocator run (and are tested) anywhere.
"""
from .intake import Intake, IntakeConfig
from .kv_cache import BlockAllocator
from .policy import PolicyConfig, PolicyInput, RunningReq, Scenario, StepKind, StepPlan, WaitingReq, blocks_needed, plan_step
from .scheduler import ScheduledChunk, Scheduler, SchedulerOutput, StepBatch
from .sequence import SamplingParams, Sequence

__all__ = ["BlockAllocator", "Intake", "IntakeConfig", "PolicyConfig", "PolicyInput", "RunningReq", "SamplingParams",
           "Scenario", "ScheduledChunk", "Scheduler", "SchedulerOutput", "Sequence", "StepBatch", "StepKind",
           "StepPlan", "WaitingReq", "blocks_needed", "plan_step"]
