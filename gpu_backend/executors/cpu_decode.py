"""FusedDecode: a quantized model's decoder stack for a step of decode rows in one C call
(cpu_kernels/forward.cc, blink_forward_decode), for KernelForward.

    KernelForward's layer plans (QuantKernelLinear projections, pool layers, norm weights)
      -> once: ctypes descriptors (Model, Layer x L, QMat x 4 a layer: each projection's row
         segments, their types, repacked blocks and output columns)
    step: x [T, hidden] (embedded tokens), cos/sin [T, D], slots, block tables, context lengths
      -> Step (pointers; scratch buffers kept while T repeats) -> blink_forward_decode(threads)
      -> normed [T, hidden]: what KernelForward's per-call loop returns, bit for bit

The per-call loop made ~14 ctypes calls and 5 OpenMP fork/joins a layer; this is one call and
one parallel region a step (forward.cc says why that matters on 2 cores). It applies when every
projection runs on quant.cc's int8 matmul (QuantKernelLinear, at most MAX_SEGMENTS segments) and
every row of the step is a decode row, up to MAX_DECODE_ROWS of them.

Decode rows stay on the int8 blocks at any batch size: QuantKernelLinear's row limit (32) is there
for prompts, whose int8 activation codes flip near-ties the float prefill keeps, and the per-call
loop applies it to any step. A decode row's codes are its own whatever shares its step, so here its
tokens do not depend on the batch size, and batches past 32 rows no longer fall to the dequantized
float GEMM: batch 64 of Q4_1 SmolLM2 ran 64.6 / 68.5 tok/s that way (a step ~1 s) against 683.7 /
191.3 on the blocks (2 threads, AVX512 EPYC, a test suite running beside it).
"""
from __future__ import annotations

import ctypes

import torch

from .cpu_linear import FX_HEAD_MAX_ROWS, FloatActHead, QuantKernelLinear

MAX_SEGMENTS = 4            # forward.cc's kMaxSegments
MAX_DECODE_ROWS = 256       # decode rows a fused step takes (cpu.MAX_BATCH_SIZE_CAP seats at most)

_i64, _f64, _ptr = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p


class QMat(ctypes.Structure):
    _fields_ = [("n", _i64), ("k", _i64), ("nseg", _i64), ("bias", _ptr),
                ("wtype", _i64 * MAX_SEGMENTS), ("col", _i64 * MAX_SEGMENTS), ("rows", _i64 * MAX_SEGMENTS),
                ("w", _ptr * MAX_SEGMENTS)]


class Layer(ctypes.Structure):
    _fields_ = [("qkv", QMat), ("o", QMat), ("gate_up", QMat), ("down", QMat), ("kc", _ptr), ("vc", _ptr),
                ("post_w", _ptr), ("next_w", _ptr), ("post_eps", _f64), ("next_eps", _f64)]


class Model(ctypes.Structure):
    _fields_ = [("layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("inter", _i64), ("num_blocks", _i64), ("block_size", _i64), ("bf16", _i64), ("isa", _i64),
                ("kv_bf16", _i64), ("first_w", _ptr), ("first_eps", _f64), ("scale", _f64),
                ("layer", ctypes.POINTER(Layer)), ("embed", _ptr), ("vocab", _i64), ("head_wtype", _i64),
                ("head_isa", _i64), ("head_w", _ptr)]


class Step(ctypes.Structure):
    _fields_ = [("tokens", _i64), ("x", _ptr), ("normed", _ptr), ("cos", _ptr), ("sin", _ptr), ("slots", _ptr),
                ("tables", _ptr), ("width", _i64), ("context_lens", _ptr), ("qkv", _ptr), ("attn", _ptr),
                ("proj", _ptr), ("gate_up", _ptr), ("act", _ptr), ("qs", _ptr), ("d", _ptr), ("s", _ptr),
                ("ids", _ptr), ("positions", _ptr), ("rope_cos", _ptr), ("rope_sin", _ptr), ("logits", _ptr),
                ("hx", _ptr), ("picks", _ptr)]


def _scratch_ptrs(b: dict[str, torch.Tensor]) -> dict[str, int]:
    """Step's scratch fields (FusedDecode._buffers: one tensor each, named as the field)."""
    return {name: t.data_ptr() for name, t in b.items()}


def _qmat(mm: QuantKernelLinear) -> QMat:
    q = QMat(n=mm.out_features, k=mm.in_features, nseg=len(mm._plan),
             bias=None if mm.bias is None else mm.bias.data_ptr())
    for i, (wtype, ptr, col, cols) in enumerate(mm._plan):
        q.wtype[i], q.w[i], q.col[i], q.rows[i] = wtype, ptr, col, cols
    return q


class FusedDecode:
    """The descriptors of one model (kept alive with the tensors they point into) and its call."""

    def __init__(self, forward, kernels) -> None:
        """forward: a KernelForward whose plans pass `fits`; kernels: the loaded CpuKernels."""
        plans = forward.plans
        mats = [[p.qkv.quant, p.o.quant, p.gate_up.quant, p.down.quant] for p in plans]
        self._fn = kernels.raw("forward_decode")
        self.hidden, self.inter = forward.hidden, mats[0][2].out_features // 2
        self.heads, self.kv_heads, self.head_dim = forward.num_heads, forward.num_kv_heads, forward.head_dim
        self.dtype = forward.model.dtype
        self._layers = (Layer * len(plans))()
        for i, (p, (qkv, o, gate_up, down)) in enumerate(zip(plans, mats)):
            self._layers[i] = Layer(qkv=_qmat(qkv), o=_qmat(o), gate_up=_qmat(gate_up), down=_qmat(down),
                                    kc=p.kc_ptr, vc=p.vc_ptr, post_w=p.post_w, next_w=p.next_w,
                                    post_eps=p.post_eps, next_eps=p.next_eps)
        model = forward.model
        self.embed = model.embed_tokens.weight                  # [vocab, hidden]: rows copied by run_ids
        self.vocab = self.embed.shape[0]
        # The tied Q8_0 head on float activations (FloatActHead), which run_ids can apply: None where
        # the model has another head (it then runs in Python on the normed rows).
        head = model.logits_head if isinstance(model.logits_head, FloatActHead) else None
        self.head = head if head is not None and head.out_features == self.vocab else None
        self._model = Model(layers=len(plans), hidden=forward.hidden, heads=self.heads, kv_heads=self.kv_heads,
                            head_dim=self.head_dim, inter=self.inter, num_blocks=forward.num_blocks,
                            block_size=forward.block_size, bf16=int(self.dtype == torch.bfloat16),
                            isa=mats[0][0].isa, kv_bf16=int(forward.kv_dtype == torch.bfloat16),
                            first_w=forward.first_w, first_eps=forward.first_eps,
                            scale=self.head_dim ** -0.5, layer=self._layers,
                            embed=self.embed.data_ptr() if self.embeds() else None, vocab=self.vocab,
                            head_wtype=self.head.wtype if self.head else 0, head_isa=self.head.isa if self.head else 0,
                            head_w=self.head._ptr if self.head else None)
        self._scratch: tuple[int, dict[str, torch.Tensor]] | None = None
        self._rows: tuple[int, dict[str, torch.Tensor]] | None = None    # run_ids' buffers: (capacity, them)
        self._ids_cache: tuple[dict, dict, Step] | None = None             # _ids_step's (row buffers, scratch, Step)
        # Decode rows a step takes here: up to MAX_DECODE_ROWS, or the batch above which this machine's
        # float weights beat the int8 blocks (cpu_crossover.decide set int8_rows at load).
        limits = [mm.int8_rows for layer in mats for mm in layer if mm.int8_rows is not None]
        self.max_rows = min([MAX_DECODE_ROWS, *limits])

    @staticmethod
    def fits(forward) -> bool:
        """Whether every projection of every layer is a QuantKernelLinear on int8 codes in the
        model's dtype with at most MAX_SEGMENTS segments, all on one isa, the MLP's halves equal."""
        isas = set()
        for p in forward.plans:
            mats = (p.qkv.quant, p.o.quant, p.gate_up.quant, p.down.quant)
            if any(mm is None or mm.float32_out or len(mm._plan) > MAX_SEGMENTS for mm in mats):
                return False
            isas.update(mm.isa for mm in mats)
            if mats[2].out_features != 2 * mats[3].in_features or mats[0].in_features != forward.hidden:
                return False
        return bool(forward.plans) and len(isas) == 1         # one path for the stack

    def embeds(self) -> bool:
        """Whether run_ids can copy the embedding rows itself: a plain table in the model's dtype."""
        e = self.embed
        return e.dtype == self.dtype and e.is_contiguous() and e.dim() == 2 and e.shape[1] == self.hidden

    def head_takes(self, tokens: int) -> bool:
        """Whether run_ids can compute the logits of `tokens` rows (the head's blocks path at that size)."""
        return self.head is not None and self.head.on_blocks(tokens, self.dtype)

    def takes(self, tokens: int, num_decode: int) -> bool:
        """Whether a step of `tokens` rows, the first `num_decode` of them decode rows, runs here."""
        return 0 < tokens == num_decode <= self.max_rows

    def _buffers(self, t: int) -> dict[str, torch.Tensor]:
        """The stack's scratch for t rows: sized for the next power of two and kept (as _row_buffers)."""
        if self._scratch is None or self._scratch[0] < t:
            t = 1 << (t - 1).bit_length()
            dt, h, kvh, d = self.dtype, self.heads, self.kv_heads, self.head_dim
            widest = max(self.hidden, h * d, self.inter)
            self._scratch = (t, {
                "qkv": torch.empty((t, (h + 2 * kvh) * d), dtype=dt),
                "attn": torch.empty((t, h * d), dtype=dt), "proj": torch.empty((t, self.hidden), dtype=dt),
                "gate_up": torch.empty((t, 2 * self.inter), dtype=dt), "act": torch.empty((t, self.inter), dtype=dt),
                "qs": torch.empty((t, widest), dtype=torch.int8), "d": torch.empty((t, widest // 32)),
                "s": torch.empty((t, widest // 32))})
        return self._scratch[1]

    def _row_buffers(self, t: int) -> dict[str, torch.Tensor]:
        """run_ids' inputs and outputs, sized for the next power of two >= t rows and kept while the
        batch fits: their first t rows serve any smaller step (row-major), so a batch that changes size
        step to step allocates nothing."""
        if self._rows is None or self._rows[0] < t:
            cap, dt = 1 << (t - 1).bit_length(), self.dtype
            # the head runs here for at most FX_HEAD_MAX_ROWS rows (head_takes): 256 rows of logits would
            # hold 50 MB of SmolLM2's 49152-wide rows for nothing
            head_rows = min(cap, FX_HEAD_MAX_ROWS) if self.head is not None else 0
            self._rows = (cap, {"x": torch.empty((cap, self.hidden), dtype=dt),
                                "cos": torch.empty((cap, self.head_dim), dtype=dt),
                                "sin": torch.empty((cap, self.head_dim), dtype=dt),
                                "normed": torch.empty((cap, self.hidden), dtype=dt),
                                "logits": torch.empty((head_rows, self.vocab)),
                                "hx": torch.empty((head_rows, self.hidden)),
                                "picks": torch.empty(cap, dtype=torch.int64)})
        return self._rows[1]

    def _ids_step(self, t: int) -> tuple[dict[str, torch.Tensor], Step]:
        """run_ids' buffers for t rows and its Step with their pointers, made again only when the
        buffers grow (a ctypes Structure of 24 fields built every step was ~20 us of Python)."""
        r, b = self._row_buffers(t), self._buffers(t)
        if self._ids_cache is None or self._ids_cache[0] is not r or self._ids_cache[1] is not b:
            step = Step(x=r["x"].data_ptr(), normed=r["normed"].data_ptr(), cos=r["cos"].data_ptr(),
                        sin=r["sin"].data_ptr(), hx=r["hx"].data_ptr(), **_scratch_ptrs(b))
            self._ids_cache = (r, b, step)
        return r, self._ids_cache[2]

    def run_ids(self, t: int, ids: int, positions: int, slots: int, tables: int, width: int, context_lens: int,
                rope_cos: torch.Tensor, rope_sin: torch.Tensor, logits: bool, picks: bool,
                threads: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """A step of t decode rows from their token ids: ids, positions, slots, context_lens [t] and
        tables [t, width] are int64 data pointers (contiguous), rope_cos / rope_sin [cap, D] the RoPE
        tables (KernelForward.rope_tables) covering every position. The embedding and RoPE rows are
        copied in C; with `logits` (head_takes(t)) the head follows, and with `picks` each row's greedy
        token (-1: a NaN row). -> (normed [t, hidden], logits [t, vocab] or None, picks [t] or None):
        views of buffers the next call overwrites, the same bits as embedding + __call__ +
        the head's forward + sampling's argmax."""
        if not self.embeds() or (logits and not self.head_takes(t)):
            raise ValueError("run_ids: this model's embedding or head is not one forward.cc reads")
        r, step = self._ids_step(t)
        step.tokens, step.slots, step.tables, step.width, step.context_lens = t, slots, tables, width, context_lens
        step.ids, step.positions, step.rope_cos, step.rope_sin = ids, positions, rope_cos.data_ptr(), rope_sin.data_ptr()
        step.logits = r["logits"].data_ptr() if logits else None
        step.picks = r["picks"].data_ptr() if logits and picks else None
        if self._fn(ctypes.byref(self._model), ctypes.byref(step), threads) != 0:
            raise RuntimeError("blink_forward_decode: a block type is not one quant.cc reads")
        return (r["normed"][:t], r["logits"][:t] if logits else None,
                r["picks"][:t] if logits and picks else None)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 tables: torch.Tensor, context_lens: torch.Tensor, threads: int) -> torch.Tensor:
        """x [T, hidden] (contiguous, the model's dtype; the residual stream, updated in place), cos/sin
        [T, D] contiguous, slots [T], tables [T, W], context_lens [T] int64 -> normed [T, hidden]."""
        t = x.shape[0]
        b = self._buffers(t)
        normed = torch.empty_like(x)          # the caller's to keep; the scratch is reused step to step
        step = Step(tokens=t, x=x.data_ptr(), normed=normed.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(),
                    slots=slots.data_ptr(), tables=tables.data_ptr(), width=tables.shape[1],
                    context_lens=context_lens.data_ptr(), **_scratch_ptrs(b))
        if self._fn(ctypes.byref(self._model), ctypes.byref(step), threads) != 0:
            raise RuntimeError("blink_forward_decode: a projection's block type is not one quant.cc reads")
        return normed
