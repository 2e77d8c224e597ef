"""Capture planning: what the graph cache needs before anything is captured.

    BucketTable (graph shapes) + ModelConfig + dtype
      -> StaticSizes: one set of static buffers sized for the largest shape
         (tokens = max rows x len, rows, block-table entries = max rows x ctx / block,
         sampler seats = max batch size, each [vocab] wide)
      -> attention row groups per shape (the scores of one group stay under a
         workspace budget, so the largest prefill graph does not need gigabytes)
      -> capture order: largest activation first, so every later graph fits in
         the memory pool the first one reserved (all graphs share one pool)
      -> MemoryEstimate: static buffers + the largest graph's activations (the
         shared pool) + per-graph instantiation overhead, to compare with what
         capture.py measures on the device

Pure Python; no CUDA (StaticSizes.nbytes reads the sampler's constants).
"""
from __future__ import annotations

import dataclasses

from ..model.config import ModelConfig
from .buckets import BucketTable, GraphShape

ATTN_WORKSPACE_BYTES = 256 << 20     # scores + probabilities of one attention row group, at most
EXEC_NODE_BYTES = 8 << 10            # device memory per kernel node of one instantiated graph (estimate)
NODES_PER_LAYER = 40                 # kernels one decoder layer captures (estimate, checked on the device)
NODES_FIXED = 60                     # staging, embedding, final norm, logits, sampling, finish


@dataclasses.dataclass(frozen=True)
class StaticSizes:
    tokens: int          # input_ids, positions, slot_mapping: [rows * len] of the largest graph
    rows: int            # per-row tensors
    table: int           # block_tables: [rows * ctx / block_size] of the widest graph
    seats: int = 1       # sampler seats (one per running request at most) besides the sink
    vocab: int = 1       # the seats' rows: [seats + 1, vocab]

    def nbytes(self) -> int:
        from .sampler import ROW_STOPS, TOP_LOGPROBS, SeatState
        per_row = (4 * 7 + 8 * 9 + 8 * ROW_STOPS + 12 * TOP_LOGPROBS     # parameters, lp_want, logprob outputs
                   + 1 + self.vocab)                                    # a structured output's allowed tokens
        return (8 * (3 * self.tokens + self.table) + self.rows * per_row
                + SeatState.nbytes_for(self.seats, self.vocab))


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    static_bytes: int            # the static buffers
    pool_bytes: int              # activations of the largest graph (the shared capture pool)
    exec_bytes: int              # instantiated graphs (two per shape)
    largest: str                 # the shape that sets the pool

    @property
    def total_bytes(self) -> int:
        return self.static_bytes + self.pool_bytes + self.exec_bytes

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes}


@dataclasses.dataclass(frozen=True)
class CapturePlan:
    table: BucketTable
    model: ModelConfig
    dtype_bytes: int = 4
    attn_workspace_bytes: int = ATTN_WORKSPACE_BYTES

    @property
    def block_size(self) -> int:
        return self.table.config.block_size

    def static_sizes(self) -> StaticSizes:
        shapes = self.table.shapes
        return StaticSizes(tokens=max(g.tokens for g in shapes), rows=max(g.rows for g in shapes),
                           table=max(g.rows * (g.ctx // self.block_size) for g in shapes),
                           seats=self.table.config.max_batch_size, vocab=self.model.vocab_size)

    def row_group(self, g: GraphShape) -> int:
        """Rows whose attention runs together: scores and probabilities of a group
        ([group, heads, len, ctx] float32, twice) stay within the workspace."""
        per_row = 2 * 4 * self.model.num_heads * g.len * g.ctx
        return max(1, min(g.rows, self.attn_workspace_bytes // max(1, per_row)))

    def activation_bytes(self, g: GraphShape) -> int:
        """Peak intermediate memory of one forward + sampling of shape g (an estimate)."""
        m, b, t = self.model, self.dtype_bytes, g.tokens
        qkv = t * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim * b
        group = self.row_group(g)
        attn = group * (2 * m.num_kv_heads * g.ctx * m.head_dim * b + 2 * 4 * m.num_heads * g.len * g.ctx)
        mlp = 3 * t * m.intermediate_size * b
        residual = 4 * t * m.hidden_size * b
        sampling = g.rows * m.vocab_size * (14 * 4 + 2 * 8)    # processors, filtering, logprobs: [R, V] each
        return residual + max(qkv + attn, mlp) + sampling

    def capture_order(self) -> list[int]:
        """Graph ids, the largest activation first."""
        return sorted(range(len(self.table.shapes)),
                      key=lambda i: (-self.activation_bytes(self.table.shapes[i]), i))

    def memory_estimate(self) -> MemoryEstimate:
        shapes = self.table.shapes
        largest = max(shapes, key=self.activation_bytes)
        nodes = self.model.num_layers * NODES_PER_LAYER + NODES_FIXED
        return MemoryEstimate(static_bytes=self.static_sizes().nbytes(), pool_bytes=self.activation_bytes(largest),
                              exec_bytes=2 * len(shapes) * nodes * EXEC_NODE_BYTES, largest=str(largest))
