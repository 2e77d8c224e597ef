"""The step function every step graph captures, and the static buffers it works on.

    GraphKVPool [L, blocks + 1, block_size, KV, D] K and V (the last block: the padding sink)
    StaticBuffers (one set, sized for the largest shape; csrc/model_step.h stages them)
      input_ids, positions, slot_mapping [rows * len]   block_tables [rows * ctx / bs]
      q_lens [rows]; the sampling parameters of each row (sampler.RowParams: temperature,
      top_p, top_k, seeds, token_index, min_p, penalties, min_tokens, stop ids, seat;
      automaton_on [rows], automaton_allowed [rows, V]: a structured output's allowed tokens)
      -> tokens [rows] and each row's logprob record (lp_token, lp_rank, lp_top_ids,
         lp_top_vals: [rows] / [rows, TOP_LOGPROBS])
      seats (sampler.SeatState [seats + 1, V]: what a request keeps between steps; filled
      when it gets a seat, updated by the graph after each sample)
    StepFunction(shape):  views of the buffers for (R rows, S len, C ctx)
      -> LlamaModel.forward over R * S tokens with GraphAttention ("torch" kernels):
           K/V of every token into the pool at slot_mapping (padding -> the sink block)
           per row group: gather the rows' blocks [g, C] -> masked GQA attention
           (key j is visible to the query at position p when j <= p)
         or fused_forward.forward ("triton"): the same function in 9 kernels a layer,
           attention reading the rows' blocks in place ("auto", the default: a GPU's
           decode steps; its prefill steps take PyTorch's operators, SDPA's fused
           attention over the gathered blocks, 12-15% faster there on the H200)
      -> hidden of each row's last real token [R, hidden] -> logits [R, V]
      -> sampler.sample_step (processors, filtering, draw, logprobs, seat update)
         -> tokens [R] and logprob records [R]

Shapes depend on the graph's (R, S, C) only, never on data; no host sync, no
allocation outside the capture pool that outlives the step (the output is
copied into the static `tokens`), so the function is capture-safe and any graph
may be replayed after any other. The same code runs eagerly on CPU tensors
(cpu_graphs.py), which is how CI checks it against the CPU executor.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..model.config import ModelConfig
from ..model.llama import LlamaModel
from . import fused_forward
from .buckets import KIND_DECODE, GraphShape
from .plan import CapturePlan, StaticSizes
from .sampler import ROW_STOPS, TOP_LOGPROBS, RowParams, SeatState, sample_step


@dataclasses.dataclass(frozen=True)
class KVShape:
    num_blocks: int           # blocks the allocator hands out; the tensors hold one more (the sink)
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: ModelConfig, num_blocks: int, block_size: int) -> "KVShape":
        return cls(num_blocks, block_size, model.num_layers, model.num_kv_heads, model.head_dim)

    def block_bytes(self, dtype_bytes: int) -> int:
        """K and V of one block, every layer."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * dtype_bytes


class GraphKVPool:
    """K and V of every layer, token-major: a gathered block is [bs, KV, D], and a token's
    slot (block * block_size + offset) indexes the flattened [blocks * bs, KV, D] view."""

    def __init__(self, shape: KVShape, dtype: torch.dtype, device: torch.device | str):
        self.shape = shape
        self.sink_block = shape.num_blocks
        dims = (shape.num_layers, shape.num_blocks + 1, shape.block_size, shape.num_kv_heads, shape.head_dim)
        self.k = torch.zeros(dims, dtype=dtype, device=device)       # [L, blocks + 1, bs, KV, D]
        self.v = torch.zeros(dims, dtype=dtype, device=device)       # [L, blocks + 1, bs, KV, D]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class StaticBuffers:
    def __init__(self, sizes: StaticSizes, device: torch.device | str):
        i64 = dict(dtype=torch.int64, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        self.sizes = sizes
        self.input_ids = torch.zeros(sizes.tokens, **i64)       # [tokens]
        self.positions = torch.zeros(sizes.tokens, **i64)       # [tokens]
        self.slot_mapping = torch.zeros(sizes.tokens, **i64)    # [tokens]
        self.block_tables = torch.zeros(sizes.table, **i64)     # [table]
        self.q_lens = torch.zeros(sizes.rows, **i64)            # [rows]
        self.temperature = torch.zeros(sizes.rows, **f32)       # [rows]
        self.top_p = torch.ones(sizes.rows, **f32)              # [rows]
        self.top_k = torch.zeros(sizes.rows, **i64)             # [rows]
        self.seeds = torch.zeros(sizes.rows, **i64)             # [rows]
        self.token_index = torch.zeros(sizes.rows, **i64)       # [rows]
        self.tokens = torch.zeros(sizes.rows, **i64)            # [rows] the step's output
        self.min_p = torch.zeros(sizes.rows, **f32)             # [rows]
        self.presence = torch.zeros(sizes.rows, **f32)          # [rows]
        self.frequency = torch.zeros(sizes.rows, **f32)         # [rows]
        self.repetition = torch.ones(sizes.rows, **f32)         # [rows]
        self.min_tokens = torch.zeros(sizes.rows, **i64)        # [rows]
        self.stop_ids = torch.full((sizes.rows, ROW_STOPS), -1, **i64)   # [rows, ROW_STOPS]
        self.seats = SeatState(sizes.seats, sizes.vocab, device)
        self.seat = torch.full((sizes.rows,), self.seats.sink, **i64)    # [rows]
        self.lp_token = torch.zeros(sizes.rows, **f32)          # [rows] outputs: the token's logprob
        self.lp_rank = torch.zeros(sizes.rows, **i64)           # [rows]
        self.lp_top_ids = torch.zeros(sizes.rows, TOP_LOGPROBS, **i64)   # [rows, TOP_LOGPROBS]
        self.lp_top_vals = torch.zeros(sizes.rows, TOP_LOGPROBS, **f32)  # [rows, TOP_LOGPROBS]
        self.automaton_on = torch.zeros(sizes.rows, dtype=torch.bool, device=device)                 # [rows]
        self.automaton_allowed = torch.zeros(sizes.rows, sizes.vocab, dtype=torch.bool, device=device)  # [rows, V]
        self.lp_want = torch.zeros(sizes.rows, **i64)          # [rows] 1: the row's logprob record is read
        self.row_params = RowParams(self.temperature, self.top_p, self.top_k, self.seeds, self.token_index,
                                    self.min_p, self.presence, self.frequency, self.repetition, self.min_tokens,
                                    self.stop_ids, self.seat, self.automaton_on, self.automaton_allowed,
                                    self.lp_want)

    def io(self, block_size: int, sink_block: int):
        """structs.StepIO: where the staging kernels write and the finish kernel reads."""
        from ..cuda import structs
        ptrs = {name: getattr(self, name).data_ptr() for name in (
            "input_ids", "positions", "slot_mapping", "block_tables", "q_lens", "temperature", "top_p", "top_k",
            "seeds", "token_index", "tokens", "min_p", "presence", "frequency", "repetition", "min_tokens",
            "stop_ids", "seat", "lp_token", "lp_rank", "lp_top_ids", "lp_top_vals", "automaton_on",
            "automaton_allowed", "lp_want")}
        st = self.seats
        ptrs.update(seat_bias=st.bias.data_ptr(), seat_counts=st.counts.data_ptr(),
                    seat_prompt_mask=st.prompt_mask.data_ptr(), seat_recent=st.recent.data_ptr(),
                    seat_bad_prefix=st.bad_prefix.data_ptr(), seat_bad_len=st.bad_len.data_ptr(),
                    seat_bad_last=st.bad_last.data_ptr())
        return structs.StepIO(**ptrs, block_size=block_size, sink_block=sink_block, sink_seat=st.sink,
                              vocab=st.vocab)

    def logprob_rows(self, rows: list[int]):
        """The logprob outputs of the given rows of the last step, on the host:
        (logprob [n] f32, rank [n] i64, top ids [n, TOP_LOGPROBS] i64, top logprobs [n, TOP_LOGPROBS] f32)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.lp_token.device)
        return tuple(t.index_select(0, idx).cpu().numpy()
                     for t in (self.lp_token, self.lp_rank, self.lp_top_ids, self.lp_top_vals))

    @property
    def nbytes(self) -> int:
        own = sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))
        return own + self.seats.nbytes


class GraphAttention:
    """AttentionBackend over the paged pool for one fixed shape (R rows x S tokens, C context).

    A step graph launches one kernel or more per operator, and for SmolLM2 at 30 layers the step
    is made of ~1,500 small ones: what each layer's attention launches counts. The visibility
    mask depends on the step's positions only, so it is made once per step (per row group, as
    an additive float mask over the grouped queries) and shared by every layer; the attention
    itself is one scaled_dot_product_attention call per row group (on a GPU a fused kernel that
    never materialises the scores; "explicit": matmul, mask, softmax, matmul, as before)."""

    IMPLS = ("sdpa", "explicit")

    def __init__(self, pool: GraphKVPool, buffers: StaticBuffers, shape: GraphShape, row_group: int,
                 impl: str = "sdpa"):
        if impl not in self.IMPLS:
            raise ValueError(f"attention impl must be one of {self.IMPLS}, got {impl!r}")
        bs = pool.shape.block_size
        r, s, c = shape.rows, shape.len, shape.ctx
        self.pool, self.shape, self.group, self.impl = pool, shape, max(1, min(row_group, r)), impl
        self.slot_mapping = buffers.slot_mapping[:r * s]                          # [R*S]
        self.tables = buffers.block_tables[:r * (c // bs)].view(r, c // bs)       # [R, C/bs]
        # key j is visible to the query at position p when j <= p (p < the row's context)
        positions = buffers.positions[:r * s].view(r, s)                          # [R, S]
        self.positions = positions
        self.key_pos = None                                                       # [C], made on first call
        self._masks: dict[int, torch.Tensor] = {}                                 # row group start -> mask

    def _visible(self, r0: int, r1: int) -> torch.Tensor:
        """[g, S, C] bool: key j is visible to the query at position p of rows [r0, r1) when j <= p."""
        return self.key_pos[None, None, :] <= self.positions[r0:r1, :, None]

    def _mask(self, r0: int, r1: int, grp: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask of rows [r0, r1) for queries grouped (query head of a KV head, token):
        [g, 1, G*S, C], 0 where the key is visible, -inf elsewhere. Kept from the first layer's call
        when one group holds every row (several groups would hold R x G*S x C at once)."""
        m = self._masks.get(r0)
        if m is None:
            s, c = self.shape.len, self.shape.ctx
            visible = self._visible(r0, r1)                                                   # [g, S, C]
            m = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
            m = m[:, None, None].expand(r1 - r0, 1, grp, s, c).reshape(r1 - r0, 1, grp * s, c)
            if self.group >= self.shape.rows:
                self._masks[r0] = m
        return m

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        r, s, c = self.shape.rows, self.shape.len, self.shape.ctx               # q: [R*S, H, D]; k, v: [R*S, KV, D]
        kc, vc = self.pool.k[layer], self.pool.v[layer]                          # [blocks + 1, bs, KV, D]
        kvh, d = kc.shape[2], kc.shape[3]
        h = q.shape[1]
        grp = h // kvh
        kc.view(-1, kvh, d).index_copy_(0, self.slot_mapping, k.to(kc.dtype))
        vc.view(-1, kvh, d).index_copy_(0, self.slot_mapping, v.to(vc.dtype))
        if self.key_pos is None:
            self.key_pos = torch.arange(c, device=q.device)                      # [C]
        # GQA without copying K/V per head: the query heads of one KV head share a row group.
        qg = q.view(r, s, kvh, grp, d).permute(0, 2, 3, 1, 4).reshape(r, kvh, grp * s, d)   # [R, KV, G*S, D]
        outs = []
        for r0 in range(0, r, self.group):                                       # static: the shape fixes it
            r1 = min(r, r0 + self.group)
            g = r1 - r0
            flat = self.tables[r0:r1].reshape(-1)                                # [g * C/bs]
            keys = kc.index_select(0, flat).view(g, c, kvh, d).permute(0, 2, 1, 3).to(q.dtype)   # [g, KV, C, D]
            vals = vc.index_select(0, flat).view(g, c, kvh, d).permute(0, 2, 1, 3).to(q.dtype)   # [g, KV, C, D]
            if self.impl == "sdpa":
                outs.append(F.scaled_dot_product_attention(qg[r0:r1], keys, vals,
                                                           attn_mask=self._mask(r0, r1, grp, q.dtype)))
                continue
            scores = torch.matmul(qg[r0:r1], keys.transpose(-1, -2)).float() * d ** -0.5      # [g, KV, G*S, C]
            scores = scores.view(g, kvh, grp, s, c).masked_fill(~self._visible(r0, r1)[:, None, None], float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype).view(g, kvh, grp * s, c)
            outs.append(torch.matmul(probs, vals))                               # [g, KV, G*S, D]
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)                # [R, KV, G*S, D]
        return o.view(r, kvh, grp, s, d).permute(0, 3, 1, 2, 4).reshape(r * s, h, d)


class StepFunction:
    """model + pool + static buffers -> run(shape): one step of that shape, tokens into buffers.tokens."""

    def __init__(self, model: LlamaModel, pool: GraphKVPool, buffers: StaticBuffers, plan: CapturePlan,
                 attention: str = "sdpa", kernels: str = "torch"):
        """kernels: "torch" (LlamaModel.forward with GraphAttention, PyTorch's operators), "triton"
        (fused_forward: the fused Triton kernels), "auto" (triton where fused_forward.resolve says,
        for decode steps: a prefill step takes PyTorch's operators, whose graphs replayed 12-15%
        faster than the Triton kernels' at 1x128 and 16x128 tokens on the H200, 2026-11-27;
        `prefill_kernels` says which)."""
        self.model, self.pool, self.buffers, self.plan, self.attention = model, pool, buffers, plan, attention
        self.kernels = fused_forward.resolve(kernels, model, pool.k.device)
        self.prefill_kernels = "torch" if kernels == "auto" else self.kernels
        if self.kernels == "triton":     # the split decode attention in this model's variant, once a process
            fused_forward.check_splits(model, pool.k.device, pool.shape.block_size)

    @torch.inference_mode()
    def forward(self, shape: GraphShape) -> torch.Tensor:
        """The model over the step's R*S tokens (K/V written into the pool) -> hidden [R*S, hidden]."""
        b = self.buffers
        r, s, c = shape.rows, shape.len, shape.ctx
        if (self.kernels if shape.kind == KIND_DECODE else self.prefill_kernels) == "triton":
            bs = self.pool.shape.block_size
            return fused_forward.forward(self.model, b.input_ids[:r * s], b.positions[:r * s], b.slot_mapping[:r * s],
                                         b.block_tables[:r * (c // bs)].view(r, c // bs), self.pool.k, self.pool.v,
                                         r, s, c)
        attn = GraphAttention(self.pool, b, shape, self.plan.row_group(shape), self.attention)
        return self.model(b.input_ids[:r * s], b.positions[:r * s], attn)

    @torch.inference_mode()
    def run(self, shape: GraphShape) -> None:
        b = self.buffers
        r, s = shape.rows, shape.len
        hidden = self.forward(shape)                                                           # [R*S, hidden]
        last = torch.arange(r, device=hidden.device) * s + (b.q_lens[:r] - 1).clamp(min=0)     # [R]
        logits = self.model.compute_logits(hidden.index_select(0, last))                       # [R, V]
        out = sample_step(logits, b.row_params.view(r), b.seats, self.kernels)
        b.tokens[:r].copy_(out.tokens)
        b.lp_token[:r].copy_(out.logprob)
        b.lp_rank[:r].copy_(out.rank)
        k = out.top_ids.shape[1]                    # TOP_LOGPROBS, or the vocabulary when smaller
        b.lp_top_ids[:r, :k].copy_(out.top_ids)
        b.lp_top_vals[:r, :k].copy_(out.top_logprobs)
