"""DecodeStep: CpuRunner's path for a step of decode rows only (every chunk one token, every one
sampled) on a quantized model, from the StepBatch to its tokens with one C call.

    StepBatch (decode chunks, in order) -> host arrays kept between steps: token ids, positions,
      pool slots, context lengths (int64 [cap]) and block tables (int64 [cap, width]; a row is
      rewritten only when its sequence's table differs from the one it holds)
    -> FusedDecode.run_ids (forward.cc): the embedding and RoPE rows, the decoder stack, then the
       tied Q8_0 head and each row's argmax where they apply
    -> tokens: the C argmax where every row is plain greedy (temperature 0, no logits processor, no
       logprobs); else sampling.sample over the logits (compute_logits of the normed rows where the
       head is not forward.cc's)

Why: the general path (CpuRunner.run: PagedBatch.build, torch tensors, embedding, RoPE gathers, the
row select and the head's buffers, the sampler's dozen small calls) took ~0.69 ms of an ~8.2 ms
1-row step of the embedded model on a 2-core Zen 1, each torch call 5-10x its warm cost (embedding
17 us warm, 93 us there): between two weight streams of ~27 MB the caches hold nothing of Python's.
That was ~8% of the step (issue 21's bandwidth goal: 1-stream decode >= 0.6 of the bound).

The same bits as the general path: the same kernels on the same data, the head's own function, and
numpy's argmax rule (first maximum; a NaN row gives -1, as nan_rows makes it).
tests/gpu_backend/executors/test_cpu_decode_step.py runs both on the same steps.
"""
from __future__ import annotations

import numpy as np
import torch

from ..sampling import MIN_TEMPERATURE, sample
from ..scheduler import StepBatch
from .cpu_forward import KernelForward


class DecodeStep:
    """The kept arrays of one runner and the step over them; __call__ returns None for a step it
    does not take (the caller runs its general path)."""

    def __init__(self, forward: KernelForward, block_size: int) -> None:
        if not self.applicable(forward):
            raise ValueError("DecodeStep needs KernelForward's fused decode with its embedding table")
        self.forward, self.fused, self.model = forward, forward.fused, forward.model
        self.block_size = block_size
        self._cap = 0
        self._grow(8, 8)

    @staticmethod
    def applicable(forward: KernelForward | None) -> bool:
        return forward is not None and forward.fused is not None and forward.fused.embeds()

    def _grow(self, rows: int, width: int) -> None:
        """Arrays for at least `rows` rows and `width` blocks a table (powers of two; the tables' rows
        forgotten, so each is written again)."""
        cap = max(self._cap, 1 << (rows - 1).bit_length())
        width = 1 << (width - 1).bit_length()
        self._cap, self._width = cap, width
        self._ids, self._pos, self._slots, self._lens = (np.zeros(cap, np.int64) for _ in range(4))
        self._tables = np.zeros((cap, width), np.int64)
        self._held: list[list[int] | None] = [None] * cap         # the table each row holds

    def __call__(self, batch: StepBatch) -> list[int] | None:
        chunks = batch.chunks
        t = len(chunks)
        if not 0 < t <= self.fused.max_rows:
            return None
        bs = self.block_size
        ids, pos, slots = [], [], []
        greedy, widest = True, 0
        for c in chunks:
            s = c.seq
            if c.num_tokens != 1 or not c.sample:
                return None
            start, p = c.start, len(s.prompt)
            if start < p:
                if s.params.prompt_logprobs is not None and start < p - 1:
                    return None                 # its prompt logprobs: the general path scores them
                ids.append(s.prompt[start])
            else:
                ids.append(s.output[start - p])
            if start // bs >= len(s.blocks):    # the kernels trust the tables (as PagedBatch.build checks)
                raise ValueError(f"position {start} outside a {len(s.blocks)}-block table")
            pos.append(start)
            slots.append(s.blocks[start // bs] * bs + start % bs)
            widest = max(widest, len(s.blocks))
            prm = s.params
            if greedy and (prm.temperature >= MIN_TEMPERATURE or prm.logprobs is not None or prm.processed):
                greedy = False
        if t > self._cap or widest > self._width:
            self._grow(t, max(widest, self._width))
        tables, held = self._tables, self._held
        for r, c in enumerate(chunks):
            blocks = c.seq.blocks
            if held[r] != blocks:
                tables[r, :len(blocks)] = blocks
                held[r] = blocks.copy()
        self._ids[:t], self._pos[:t], self._slots[:t] = ids, pos, slots
        lens = self._lens
        lens[:t] = pos
        lens[:t] += 1
        cos, sin = self.forward.rope_tables(max(pos) + 1, self.fused.dtype)
        head = self.fused.head_takes(t)
        normed, logits, picks = self.fused.run_ids(
            t, self._ids.ctypes.data, self._pos.ctypes.data, self._slots.ctypes.data, tables.ctypes.data,
            self._width, lens.ctypes.data, cos, sin, head, greedy, torch.get_num_threads())
        if picks is not None:
            return picks.tolist()
        if logits is None:
            logits = self.model.compute_logits(normed)
        return sample(logits, [c.seq for c in chunks])
