"""The CPU reference executor: the engine (engine.py) with a PyTorch runner.

    load_model(spec) -> LlamaModel (--dtype; bf16 where the CPU has it; --dtype auto keeps a
    GGUF's quantized matrices in their blocks) -> prepare_model (cpu_linear.py: fused q|k|v
    and gate|up, quantized ones on quant.cc's integer matmul, oneDNN-prepacked bf16 weights)
    -> cpu_crossover.decide (the decode batch above which float weights beat the int8 blocks here)
    + KVPool sized from --kv-cache-mb (and the seats from it), in --kv-cache-dtype (resolve_kv_dtype:
    the model's, or bf16 under quantized weights computed in float32) -> Engine(ring, CpuRunner) -> per step:
      a step of decode rows only on a quantized model: cpu_decode_step.DecodeStep (token ids to tokens
      in one C call, the same bits); any other step:
      StepBatch -> flat batch (single-token chunks first, then prefill chunks):
      input_ids [T], positions [T], PagedBatch -> KernelForward (cpu_forward.py: the
      fused C++ kernels of gpu_backend/cpu_kernels between the matmuls) where the model
      and the machine allow, else model.forward with PagedAttention -> hidden of each
      sampled chunk's last token [N, hidden] -> compute_logits [N, vocab] -> sampling.sample;
      prefill chunks of a request that asks for prompt logprobs: every row's logits, a slice
      at a time -> logprobs.records into seq.prompt_logprobs (row p scores prompt token p + 1)

Runs everywhere; the embedded default and what CI exercises end to end.
"""
from __future__ import annotations

import os
import logging
import threading

import numpy as np
import torch

from shared_layout import Ring

from ..engine import Engine, EngineConfig
from ..scheduler import StepBatch
from ..scheduler.intake import IntakeConfig
from ..kv_pool import KVCacheConfig, KVPool, blocks_for_budget
from .. import cpu_kernels
from ..model.llama import LlamaModel
from ..paged_attention import PagedAttention, PagedBatch
from ..scheduler.policy import PolicyConfig, blocks_needed
from ..logprobs import PROMPT_ROWS, records
from ..sampling import sample
from ..scheduler.sequence import Sequence
from . import ExecutorOptions
from .cpu_crossover import decide as decide_crossover
from .cpu_decode_step import DecodeStep
from .cpu_forward import KernelForward
from .cpu_linear import QuantKernelLinear, prepare_model

log = logging.getLogger("blink.gpu_daemon")

MAX_BATCH_SIZE_CAP = 256         # seats at most when sized from the KV pool
SEAT_TOKENS = 256                # prompt + output tokens a seat is sized for
DEFAULT_MAX_PREFILL_TOKENS = 2048
DEFAULT_KV_CACHE_MB = 1024


class CpuRunner:
    """Runs one StepBatch through the model over the paged pool and samples."""

    def __init__(self, model: LlamaModel, pool: KVPool, kernels: cpu_kernels.CpuKernels | None = None):
        self.model = model
        self.pool = pool
        self.attn = PagedAttention(pool)
        self.block_size = pool.config.block_size
        # The fused-kernel layer where it applies (fused bf16/f32 model, kernels built); else PyTorch ops.
        self.kernel_forward = KernelForward(model, pool, kernels) if KernelForward.applicable(model, kernels) else None
        # Decode-only steps of a quantized model: from the StepBatch to tokens in one C call (None: not here).
        self.decode_step = DecodeStep(self.kernel_forward, self.block_size) \
            if DecodeStep.applicable(self.kernel_forward) else None

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> list[int]:
        if self.decode_step is not None:
            tokens = self.decode_step(batch)
            if tokens is not None:
                return tokens
        order = sorted(range(len(batch.chunks)), key=lambda i: batch.chunks[i].num_tokens != 1)  # stable
        ids: list[int] = []
        positions: list[int] = []
        last_row: dict[int, int] = {}          # chunk index -> row of its last token
        prompt_lp: list[tuple[Sequence, int, int]] = []   # (seq, first row, prompt tokens) to score
        for i in order:
            c = batch.chunks[i]
            if c.seq.params.prompt_logprobs is not None and not c.seq.output and c.start < len(c.seq.prompt) - 1:
                prompt_lp.append((c.seq, len(ids), min(c.num_tokens, len(c.seq.prompt) - 1 - c.start)))
            ids += c.seq.token_slice(c.start, c.start + c.num_tokens)
            positions += range(c.start, c.start + c.num_tokens)
            last_row[i] = len(ids) - 1
        paged = PagedBatch.build(
            [(batch.chunks[i].start, batch.chunks[i].num_tokens, batch.chunks[i].seq.blocks) for i in order],
            self.block_size)
        input_ids, pos = torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long)
        if self.kernel_forward is not None:
            hidden = self.kernel_forward(input_ids, pos, paged)                               # [T, hidden]
        else:
            self.attn.batch = paged
            try:
                hidden = self.model(input_ids, pos, self.attn)                                # [T, hidden]
            finally:
                self.attn.batch = None
        for (seq, row, n), start in zip(prompt_lp, (positions[r] for _, r, _ in prompt_lp)):
            self._prompt_logprobs(seq, hidden, row, start, n)
        sampled = [i for i, c in enumerate(batch.chunks) if c.sample]
        if not sampled:
            return []
        rows = torch.tensor([last_row[i] for i in sampled], dtype=torch.long)
        logits = self.model.compute_logits(hidden[rows])                                    # [N, vocab]
        return sample(logits, [batch.chunks[i].seq for i in sampled])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """A fork's copy-on-write of the prompt's partial last block (engine._fork)."""
        self.pool.copy_blocks(pairs)

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, row: int, start: int, n: int) -> None:
        """Records of prompt tokens start+1 .. start+n from hidden rows row .. row+n-1 (row p
        predicts position p + 1), PROMPT_ROWS rows of logits at a time."""
        k = seq.params.prompt_logprobs
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = np.zeros((len(seq.prompt) - 1, 2 + 2 * k), "<i4")
        for a in range(0, n, PROMPT_ROWS):
            b = min(n, a + PROMPT_ROWS)
            logits = self.model.compute_logits(hidden[row + a:row + b])                       # [b - a, vocab]
            targets = torch.tensor(seq.prompt[start + a + 1:start + b + 1], dtype=torch.long)
            seq.prompt_logprobs[start + a:start + b] = records(logits, targets, k)


def tune_malloc() -> bool:
    """Keep the step's large temporaries on the heap and the heap resident (glibc only).

    glibc serves blocks over its mmap threshold (128 KiB, rising to at most 32 MiB)
    with fresh mmaps and trims the heap top back to the OS on free, so every decode
    step page-faults and zeroes its attention gathers anew: batch-32 decode attention
    took 2.6-3.2 ms a layer that way and 0.45 ms with both settings below (the dev
    machine, bf16, 1 thread). The cost is that RSS stays at the step's high-water mark,
    which the batch and prefill limits bound. Process-wide; False where not glibc.
    """
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 512 << 20))


KERNEL_CACHE_CAPACITY = 128


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> None:
    """Cap oneDNN's primitive cache and ideep's LRU cache (1024 entries each by default).

    Both are keyed by shape, and every prefill length, decode batch size and attention
    context length makes new entries of up to a few hundred KiB: with the defaults the
    daemon's heap grew ~1 MiB a request for the first thousand or so distinct shapes
    (+324 MiB in-use over 250 mixed requests), which a soak reads as a leak. At 128 each
    the heap stays flat (+10 MiB over 200 requests) at the same speed: the decode shapes
    recur every step, so the LRU keeps them. Both are read when the first kernel is made,
    so this must run before the model's first matmul; an operator's setting wins.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(capacity))


def default_max_batch_size(num_blocks: int, block_size: int) -> int:
    """Seats when --max-batch-size is not given: as many SEAT_TOKENS-token requests as the KV
    pool holds, capped at MAX_BATCH_SIZE_CAP (1 GiB of float32 SmolLM2 KV: 91 seats; it was a
    fixed 32, so 64 streams queued behind 32). Longer requests are still safe: the policy admits
    only what the free blocks hold and preempts when a decode step runs out."""
    return max(1, min(MAX_BATCH_SIZE_CAP, num_blocks // blocks_needed(SEAT_TOKENS, block_size)))


def default_threads() -> int:
    """Torch threads when --threads is not given: every core this process may use.

    The frontend is mostly waiting, so cores-1 left one of two cores idle: on an idle 2-core
    Xeon `--threads 2` served 61 / 332 / 473 tok/s at 1 / 8 / 16 streams against 38 / 206 / 311
    with one (issue 21). What made two threads dangerous is OpenMP's spinning: with a worker
    on every core, one preempted by the frontend or a neighbour stalls every parallel region
    of the step (~300) until it runs again. On the shared 2-core AVX2 dev machine under load
    (load average ~7, Q4_1 SmolLM2, bench in-process): 1 thread 18.4 / 57.2 tok/s at batch
    1 / 8; 2 threads with libgomp's default waits 1.0 / 2.9; 2 threads with passive waits
    18.6 / 37.7. Fully passive waits cost on an idle box, though: every parallel region of a
    decode step (~120 at batch 1) then pays a futex wake-up. Same machine, Q4_1 SmolLM2,
    batch-1 decode in-process, 2 threads, idle / beside two busy-looping processes:
    PASSIVE 29.8 / 16.1 tok/s, GOMP_SPINCOUNT 3000 40.8 / 12.5, 10000 46.8 / 10.8,
    libgomp's default 46 / 1.3. So the daemon spins a bounded while (gpu_backend/cli.py sets
    GOMP_SPINCOUNT=10000 unless the operator set it or OMP_WAIT_POLICY) and uses every core:
    idle-box speed, and a slowdown under CPU hogs rather than a collapse
    (OMP_WAIT_POLICY=PASSIVE keeps the most under heavy interference).
    """
    return max(1, len(os.sched_getaffinity(0)))


def resolve_dtype(name: str) -> torch.dtype:
    """--dtype: auto picks bfloat16 where the CPU has native bf16 math (2-3x faster decode
    linears than float32 on such a CPU, half the weight and KV bytes), else float32."""
    if name == "auto":
        name = "bfloat16" if cpu_has_native_bf16() else "float32"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, quantized: bool,
                     kernels: cpu_kernels.CpuKernels | None) -> torch.dtype:
    """--kv-cache-dtype: auto keeps the model's dtype (vLLM's auto), except for a model served on
    its quantized blocks (the embedded Q4_1 GGUF) in float32 on the CPU kernels (CPUs without bf16
    math, e.g. AVX2-only): there bfloat16, as llama.cpp keeps its K/V in f16 under quantized weights.
    The activations there are int8 codes for every matmul already; bf16 K/V halve the bytes a
    decode step reads from the pool (at SmolLM2's shape 46 KiB a position in float32: ~9 MB a token
    at a 200-token context, ~9% of what its weights add) and double the sequences a KV budget holds.
    float32 under bfloat16 activations gains nothing and is refused."""
    if name == "auto":
        mixed = quantized and model_dtype == torch.float32 and kernels is not None
        return torch.bfloat16 if mixed else model_dtype
    kv = {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
    if model_dtype == torch.bfloat16 and kv == torch.float32:
        raise ValueError("--kv-cache-dtype float32 under --dtype bfloat16: a float32 cache of bfloat16 "
                         "activations holds nothing more; use auto or bfloat16")
    return kv


def cpu_has_native_bf16() -> bool:
    """The CPU's flags say bf16 math (AVX512-BF16 or AMX), and BLINK_CPU_ISA, where set, does not
    narrow the kernels below it: BLINK_CPU_ISA=avx2 on this CPU then serves as an AVX2-only CPU
    would (float32 activations on the quantized weights), which is what that switch is for."""
    bf16_isa = cpu_kernels.ISA_NAMES.index("avx512bf16")
    if cpu_kernels.requested_isa(bf16_isa) < bf16_isa:
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class CpuExecutor:
    name = "cpu"

    def __init__(self, options: ExecutorOptions, model: LlamaModel | None = None, kernels: bool = True):
        """Load options.model (or take `model`, for tests and benchmarks) and size the KV pool;
        kernels=False keeps the PyTorch layer and oneDNN matmuls (the benchmark's comparison)."""
        torch.set_num_threads(options.threads or default_threads())
        tune_malloc()
        bound_kernel_caches()
        if model is None:
            from ..model.loader import load_model
            # --dtype auto keeps a GGUF's quantized matrices in their blocks (the embedded model's Q4_1)
            model = load_model(options.model, dtype=resolve_dtype(options.dtype),
                               quantized=options.dtype == "auto").model
        self.kernels = cpu_kernels.load() if kernels else None   # None also without g++ / BLINK_CPU_KERNELS=0
        self.model = prepare_model(model, self.kernels)    # in place: fused projections, packed bf16 matmuls
        decide_crossover(self.model)     # the decode batch from which float weights win here (quantized models)
        self.options = options
        cfg = model.config
        bs = options.block_size
        quantized = any(isinstance(m, QuantKernelLinear) for m in model.modules())
        self.kv_dtype = resolve_kv_dtype(options.kv_cache_dtype, model.dtype, quantized, self.kernels)
        dtype_bytes = torch.finfo(self.kv_dtype).bits // 8
        num_blocks = blocks_for_budget((options.kv_cache_mb or DEFAULT_KV_CACHE_MB) * 1024 * 1024,
                                       cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, bs, dtype_bytes)
        if num_blocks < 1:
            raise ValueError(f"--kv-cache-mb {options.kv_cache_mb} holds no {bs}-token KV block")
        max_len = min(options.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if max_len > num_blocks * bs:
            log.warning("context capped at %d tokens: the KV pool (%d blocks of %d) holds no more",
                        num_blocks * bs, num_blocks, bs)
            max_len = num_blocks * bs
        if max_len < 2:
            raise ValueError("the context must hold at least 2 tokens")
        self.vocab_size = cfg.vocab_size
        self.max_model_len = max_len
        self.eos_ids = tuple(cfg.eos_token_ids)
        self.policy = options.sched(PolicyConfig(
            max_batch_size=options.max_batch_size or default_max_batch_size(num_blocks, bs),
            max_prefill_tokens=options.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS, block_size=bs))
        self.pool = KVPool(KVCacheConfig(num_blocks, bs, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim),
                           dtype=self.kv_dtype, device=model.device)
        log.info("KV pool: %d blocks of %d tokens (%.0f MiB, %s), context %d", num_blocks, bs,
                 self.pool.nbytes / 2**20, str(self.kv_dtype).removeprefix("torch."), max_len)
        assert blocks_needed(max_len, bs) <= num_blocks

    def engine(self, ring: Ring, scenario=None) -> Engine:
        runner = CpuRunner(self.model, self.pool, self.kernels)
        log.info("decoder layer: %s", "fused C++ kernels" if runner.kernel_forward else "PyTorch ops")
        return Engine(ring, runner,
                      EngineConfig(self.policy, self.pool.config.num_blocks,
                                   shutdown_grace_s=self.options.shutdown_grace_s,
                                   prefix_caching=self.options.prefix_caching,
                                   doorbell=self.options.doorbell),
                      self.options.slo(IntakeConfig(self.vocab_size, self.max_model_len, self.eos_ids)),
                      scenario=scenario)

    def serve(self, ring: Ring, stop: threading.Event) -> None:
        engine = self.engine(ring, self.options.scenario(self.policy))
        try:
            engine.serve(stop)
        finally:
            self.options.save_scenario(engine.scheduler.scenario)

    def close(self) -> None:
        pass
