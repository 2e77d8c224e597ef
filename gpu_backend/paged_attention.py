"""PagedAttention: an AttentionBackend over the paged KV pool for a flat batch
that mixes prefill chunks and single-token decodes of different sequences.

    per step: chunks (start position, token count, block table) -> PagedBatch
      (slot_mapping [T], decode block tables [Bd, max_blocks] + key mask,
       prefill spans) -> attn.batch = it -> LlamaModel.forward calls
    attn(layer, q, k, v):
      1. write every token's k/v into its block slot (index_copy_ on the pool)
      2. decodes (the first num_decode rows, one token each): gather K/V by
         block table into a padded [kv_heads, Bd, L, D] batch, one masked
         matmul-softmax-matmul for all of them (batch-16 decode is one pass, not 16)
      3. prefill spans: one SDPA per sequence over its cached blocks, causal
         within the new chunk (bottom-right aligned)

Plain PyTorch on whatever device the pool lives on; everything host-side
(tables, masks) is built once per step, not per layer.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from .kv_pool import KVPool
from .model.attention import causal_attention


@dataclasses.dataclass(frozen=True)
class PrefillSpan:
    token_start: int            # first row of this chunk in the flat batch
    num_tokens: int             # rows in the chunk
    context_len: int            # tokens cached after this step (start position + num_tokens)
    block_table: torch.Tensor   # [blocks] int64, covering context_len


@dataclasses.dataclass(frozen=True)
class PagedBatch:
    slot_mapping: torch.Tensor          # [T] int64: block * block_size + offset of each token
    num_decode: int                     # the first num_decode rows are single-token chunks
    decode_block_tables: torch.Tensor   # [Bd, max_blocks] int64, padded with block 0
    prefills: tuple[PrefillSpan, ...]
    decode_context_lens: torch.Tensor   # [Bd] int64: cached positions each decode attends to
    block_size: int

    @functools.cached_property
    def decode_key_mask(self) -> torch.Tensor:
        """[1, Bd, 1, max_blocks * block_size] bool, True = attend: built when PagedAttention first
        asks (the C++ kernels take the context lengths instead)."""
        tables, ctx = self.decode_block_tables, self.decode_context_lens
        mask = torch.arange(tables.shape[1] * self.block_size, device=ctx.device)[None, :] < ctx[:, None]
        return mask[None, :, None, :]

    @classmethod
    def build(cls, chunks: list[tuple[int, int, list[int]]], block_size: int,
              device: torch.device | str = "cpu") -> "PagedBatch":
        """chunks: (start position, tokens, block table) in flat-batch order; the
        single-token chunks must come first (they form the vectorised decode group).
        Host arrays in numpy, one tensor each at the end: a 1-row decode step's build was
        ~0.1 ms of torch calls (2% of a SmolLM2 step)."""
        num_decode = 0
        while num_decode < len(chunks) and chunks[num_decode][1] == 1:
            num_decode += 1
        if any(n == 1 for _, n, _ in chunks[num_decode:]):
            raise ValueError("single-token chunks must lead the batch")
        slots: list[int] = []
        for start, n, table in chunks:
            if (start + n + block_size - 1) // block_size > len(table):     # the kernels trust the tables
                raise ValueError(f"positions {start}..{start + n - 1} outside a {len(table)}-block table")
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        dec = chunks[:num_decode]
        max_blocks = max((len(t) for _, _, t in dec), default=0)
        tables = np.zeros((num_decode, max_blocks), np.int64)                          # [Bd, max_blocks]
        for i, (_, _, table) in enumerate(dec):
            tables[i, :len(table)] = table
        ctx = np.fromiter((start + 1 for start, _, _ in dec), np.int64, num_decode)      # [Bd]
        spans, row = [], num_decode
        for start, n, table in chunks[num_decode:]:
            spans.append(PrefillSpan(row, n, start + n, torch.tensor(table, dtype=torch.long, device=device)))
            row += n
        return cls(torch.tensor(slots, dtype=torch.long, device=device), num_decode,
                   torch.from_numpy(tables).to(device), tuple(spans), torch.from_numpy(ctx).to(device), block_size)


class PagedAttention:
    """AttentionBackend over a KVPool; set `batch` before each forward."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.block_size = pool.config.block_size
        self.batch: PagedBatch | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = self.batch                                       # q: [T, H, D]; k, v: [T, KV, D]
        kc, vc = self.pool.k[layer], self.pool.v[layer]      # [KV, blocks, bs, D]
        kvh, d = kc.shape[0], kc.shape[3]
        kc.view(kvh, -1, d).index_copy_(1, b.slot_mapping, k.transpose(0, 1).to(kc.dtype))
        vc.view(kvh, -1, d).index_copy_(1, b.slot_mapping, v.transpose(0, 1).to(vc.dtype))
        nd = b.num_decode
        if not b.prefills:                                   # decode-only step: no output to assemble
            return self._decode(q, kc, vc, b)
        out = torch.empty_like(q)                            # [T, H, D]
        if nd:
            out[:nd] = self._decode(q[:nd], kc, vc, b)
        prefill_attention(q, k, v, kc, vc, b, out)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, b: PagedBatch) -> torch.Tensor:
        bd, h, d = q.shape                                   # q: [Bd, H, D]
        kvh = kc.shape[0]
        flat = b.decode_block_tables.view(-1)                # [Bd * MB]
        # index_select copies whole blocks in one pass (several times faster than kc[:, tables] on CPU)
        # and leaves each (kv head, sequence) context contiguous: no transposing copy below.
        keys = kc.index_select(1, flat).view(kvh, bd, -1, d).to(q.dtype)       # [KV, Bd, L, D]
        vals = vc.index_select(1, flat).view(kvh, bd, -1, d).to(q.dtype)       # [KV, Bd, L, D]
        # GQA without copying K/V per head: the query heads of one KV head form a row group.
        qg = q.view(bd, kvh, h // kvh, d).transpose(0, 1)                      # [KV, Bd, G, D]
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * d ** -0.5          # [KV, Bd, G, L]
        scores = scores.masked_fill(~b.decode_key_mask, float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), vals)                  # [KV, Bd, G, D]
        return o.transpose(0, 1).reshape(bd, h, d)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                      b: PagedBatch, out: torch.Tensor) -> None:
    """out[rows of each prefill span] = causal attention of the span's queries over its context:
    the chunk itself for a fresh sequence, else the cached blocks (this chunk's k/v already in
    the pool). q, out: [T, H, D]; k, v: [T, KV, D]; kc, vc: one pool layer [KV, blocks, bs, D]."""
    kvh, d = kc.shape[0], kc.shape[3]
    for s in b.prefills:
        rows = slice(s.token_start, s.token_start + s.num_tokens)
        if s.context_len == s.num_tokens:                # fresh sequence: the chunk is all its context
            out[rows] = causal_attention(q[rows], k[rows], v[rows])
        else:
            keys = kc.index_select(1, s.block_table).view(kvh, -1, d)[:, :s.context_len]   # [KV, ctx, D]
            vals = vc.index_select(1, s.block_table).view(kvh, -1, d)[:, :s.context_len]
            out[rows] = causal_attention(q[rows], keys.transpose(0, 1).to(q.dtype),
                                         vals.transpose(0, 1).to(q.dtype))
