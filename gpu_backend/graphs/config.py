"""GraphExecConfig: what both CUDA executors (persistent and host loop) derive
from the daemon's flags and the model, so an A/B comparison differs only in
who schedules.

    ExecutorOptions + ModelConfig (+ the environment, read here and nowhere else:
    BLINK_GRAPH_BUCKETS  JSON overrides of BucketConfig fields, e.g. '{"decode_rows": [1, 64, 256]}'
    BLINK_GRAPH_BLAS     "cublas" or "cublaslt": torch's preferred BLAS library while capturing,
                         should one library's kernels refuse device launch on some GPU
    BLINK_GRAPH_KERNELS  "auto" (default), "triton" or "torch": the kernels of the model's
                         forward in a step graph (graphs/fused_forward.py; "auto": Triton's for
                         decode steps on a GPU, PyTorch's for prefill; "torch" for an A/B)
      -> policy (max batch, prefill budget, block size), KV pool blocks,
         max_model_len, BucketConfig (grids), dtype, BLAS choice, step kernels
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import torch

from ..executors import cuda_dtype_name
from ..kv_pool import blocks_for_budget
from ..model.config import ModelConfig
from ..scheduler.policy import PolicyConfig, blocks_needed
from .buckets import BucketConfig
from .fused_forward import KERNELS

DEFAULT_MAX_BATCH_SIZE = 256
DEFAULT_MAX_PREFILL_TOKENS = 2048
DEFAULT_KV_CACHE_MB = 8192
DEFAULT_SPLIT_LEN = 512
CTX_CELL_TOKENS = 128
BUCKETS_ENV = "BLINK_GRAPH_BUCKETS"
BLAS_ENV = "BLINK_GRAPH_BLAS"
KERNELS_ENV = "BLINK_GRAPH_KERNELS"


class GraphConfigError(ValueError):
    """The flags cannot make a graph cache; str() is one line for the user."""


def graph_dtype(option: str) -> torch.dtype:
    """--dtype of the CUDA executors: auto and bfloat16 -> bfloat16 weights, activations and KV cache
    (tensor-core matmuls, half the bytes; the sampler stays float32; executors.CUDA_AUTO_DTYPE says
    why auto is bf16), float32 -> float32 (the step graphs then agree with the CPU reference but for
    near ties: what the GPU tests compare in)."""
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if option != "auto" and option not in dtypes:
        raise GraphConfigError(f"--dtype must be one of auto, {', '.join(dtypes)}, got {option!r}")
    return dtypes[cuda_dtype_name(option)]


def _bucket_overrides() -> dict:
    raw = os.environ.get(BUCKETS_ENV, "").strip()
    if not raw:
        return {}
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as e:
        raise GraphConfigError(f"{BUCKETS_ENV} is not JSON ({e})") from None
    fields = {f.name for f in dataclasses.fields(BucketConfig)}
    if not isinstance(d, dict) or set(d) - fields:
        raise GraphConfigError(f"{BUCKETS_ENV} must be a JSON object with keys from {sorted(fields)}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


@dataclasses.dataclass(frozen=True)
class GraphExecConfig:
    policy: PolicyConfig
    num_blocks: int            # KV blocks the allocator hands out (the pool has one more: the sink)
    max_model_len: int
    buckets: BucketConfig
    dtype: torch.dtype = torch.float32
    blas: str | None = None    # torch.backends.cuda.preferred_blas_library while capturing; None: torch's default
    kernels: str = "auto"      # the step's forward: fused_forward.KERNELS

    def apply_blas(self) -> None:
        if self.blas is not None:
            torch.backends.cuda.preferred_blas_library(self.blas)

    @classmethod
    def from_options(cls, options, model: ModelConfig, dtype: torch.dtype = torch.float32) -> "GraphExecConfig":
        bs = options.block_size
        policy = PolicyConfig(max_batch_size=options.max_batch_size or DEFAULT_MAX_BATCH_SIZE,
                              max_prefill_tokens=options.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS,
                              block_size=bs)
        max_len = min(options.max_model_len or model.max_position_embeddings, model.max_position_embeddings)
        dtype_bytes = torch.finfo(dtype).bits // 8
        num_blocks = blocks_for_budget((options.kv_cache_mb or DEFAULT_KV_CACHE_MB) << 20, model.num_layers,
                                       model.num_kv_heads, model.head_dim, bs, dtype_bytes)
        if num_blocks < 1:
            raise GraphConfigError(f"--kv-cache-mb {options.kv_cache_mb} holds no {bs}-token KV block")
        max_len = min(max_len, num_blocks * bs)          # one request alone always fits the pool
        if max_len < 2:
            raise GraphConfigError("the context must hold at least 2 tokens")
        split = min(DEFAULT_SPLIT_LEN, policy.max_prefill_tokens)
        ctx_grid = tuple(c for c in (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768) if c < max_len)
        # context cells of 128 tokens (every context bucket is a multiple): a small table, still exact
        kw = dict(max_batch_size=policy.max_batch_size, max_prefill_tokens=policy.max_prefill_tokens,
                  max_model_len=max_len, block_size=bs, split_len=max(16, split), len_granularity=16,
                  ctx_granularity=math.lcm(bs, CTX_CELL_TOKENS), prefill_ctxs=(max(16, split),),
                  decode_ctxs=ctx_grid)
        kw.update(_bucket_overrides())
        try:
            buckets = BucketConfig(**kw)
        except (TypeError, ValueError) as e:
            raise GraphConfigError(f"graph buckets: {e}") from None
        assert blocks_needed(max_len, bs) <= num_blocks
        blas = os.environ.get(BLAS_ENV, "").strip() or None
        if blas not in (None, "cublas", "cublaslt"):
            raise GraphConfigError(f"{BLAS_ENV} must be cublas or cublaslt, got {blas!r}")
        kernels = os.environ.get(KERNELS_ENV, "").strip() or "auto"
        if kernels not in KERNELS:
            raise GraphConfigError(f"{KERNELS_ENV} must be one of {', '.join(KERNELS)}, got {kernels!r}")
        return cls(policy, num_blocks, max_len, buckets, dtype, blas, kernels)
