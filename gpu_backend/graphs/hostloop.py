"""The host loop: the same step graphs, launched by the host each step, with the
batch reassembled on the host (paper Fig. 3's CPU-resident baseline).

    Engine (gpu_backend/engine.py: intake, policy.plan_step, KV BlockAllocator,
    publishing, all on the host) -> StepBatch -> HostLoopRunner.run:
      chunks -> step key -> BucketTable.lookup (O(1)) -> rows (fill_rows)
      -> StepBlock, compact: chunk i's request copy in reqs[i] (with the sampling
         surface: min_p, penalties, min_tokens and the ids it masks, the sampler seat),
         its block table in tables[i], rows naming chunk i (so the graph's staging
         kernel reads them exactly as it reads the scheduler's per-slot arrays)
      -> SeatTable: a request with penalties, logit_bias, allowed ids or bad words gets
         a sampler seat at its first step, filled then from its parameters, prompt and
         output (sampler.SeatState.fill; the graph updates it after each sample)
      -> Launcher: copy the used parts to the device, launch the graph, copy the
         sampled tokens back, wait (the per-step PCIe round trip and host
         synchronisation the persistent scheduler removes)
      -> one token per sampling chunk, back to the Engine, which publishes them; the
         logprob record of each sampling row that asks for one goes into its
         sequence's step_logprobs (the Engine publishes it with the token)

The StepBlock layout is one contiguous region so the device copy has the same
offsets. `table=None` runs the stand-in echo graph (the null model).
"""
from __future__ import annotations

import ctypes
import os
import weakref
from typing import Protocol

import numpy as np

from shared_layout import Ring

from ..scheduler import StepBatch
from ..scheduler.policy import StepKind
from .buckets import KIND_DECODE, KIND_PREFILL, ROW_CHUNK, ROW_LOGPROBS, ROW_SAMPLE, BucketTable


def _align(x: int, a: int = 64) -> int:
    return -(-x // a) * a


class StepBlock:
    """The host loop's per-step inputs and outputs in one region (host memory, or pinned
    memory the launcher mirrors in device memory at the same offsets)."""

    @staticmethod
    def layout_of(max_chunks: int, max_rows: int, max_blocks: int) -> tuple[dict[str, int], int]:
        """(offset of each part, total bytes)."""
        from ..cuda import structs
        rows = max(1, max_rows)
        off, layout = 0, {}
        for name, nbytes in (("state", ctypes.sizeof(structs.SchedState)),
                             ("row_slot", 4 * rows), ("row_start", 4 * rows), ("row_len", 4 * rows),
                             ("row_flags", 4 * rows), ("chunk_slot", 4 * max_chunks), ("chunk_sample", 4 * max_chunks),
                             ("reqs", ctypes.sizeof(structs.Req) * max_chunks),
                             ("kv_tables", 4 * max_chunks * max_blocks),
                             ("step_tokens", 4 * max_chunks), ("done", 8)):
            layout[name] = off
            off = _align(off + nbytes)
        return layout, off

    def __init__(self, max_chunks: int, max_rows: int, max_blocks: int, host_addr: int | None = None):
        """host_addr: zeroed memory of layout_of(...)[1] bytes (pinned, for the GPU); None: numpy."""
        from ..cuda import structs
        self.max_chunks, self.max_rows, self.max_blocks = max_chunks, max(1, max_rows), max_blocks
        layout, off = self.layout_of(max_chunks, max_rows, max_blocks)
        self.layout, self.nbytes = layout, off
        self._own = None
        if host_addr is None:
            self._own = np.zeros(off, np.uint8)
            host_addr = self._own.ctypes.data
        self.addr = host_addr

        def u32(name, n):
            return np.ctypeslib.as_array((ctypes.c_uint32 * n).from_address(host_addr + layout[name]))

        self.state = structs.SchedState.from_address(host_addr + layout["state"])
        self.row_slot, self.row_start = u32("row_slot", self.max_rows), u32("row_start", self.max_rows)
        self.row_len, self.row_flags = u32("row_len", self.max_rows), u32("row_flags", self.max_rows)
        self.chunk_slot, self.chunk_sample = u32("chunk_slot", max_chunks), u32("chunk_sample", max_chunks)
        self.reqs = (structs.Req * max_chunks).from_address(host_addr + layout["reqs"])
        self.tables = u32("kv_tables", max_chunks * max_blocks).reshape(max_chunks, max_blocks)
        self.step_tokens = np.ctypeslib.as_array(
            (ctypes.c_int32 * max_chunks).from_address(host_addr + layout["step_tokens"]))

    def params(self, base_addr: int, ring_addr: int, ring: Ring):
        """structs.SchedParams for the graphs' kernels with this block at `base_addr` (the
        device's copy, or this host memory) and the ring at `ring_addr`; the staging kernel
        keeps token ids below the vocabulary the ring header publishes."""
        from ..cuda import structs
        g = ring.geom
        p = structs.SchedParams(ring=ring_addr, slot_count=self.max_chunks,
                                prompt_arena_tokens=g.prompt_arena_tokens, output_arena_tokens=g.output_arena_tokens,
                                slots_offset=g.slots_offset, prompt_arena_offset=g.prompt_arena_offset,
                                output_arena_offset=g.output_arena_offset, logprob_arena_offset=g.logprob_arena_offset,
                                logprob_arena_words=g.logprob_arena_words, kv_max_blocks=self.max_blocks)
        p.policy.vocab_size = ring.get("model_vocab_size") or 0xFFFF_FFFF
        for name, off in self.layout.items():
            setattr(p, name, base_addr + off)
        return p

    def extents(self, n_chunks: int) -> list[tuple[int, int]]:
        """(offset, bytes) of what a step with n_chunks chunks wrote: the state and rows, then
        its request copies and block tables."""
        from ..cuda import structs
        head = self.layout["reqs"]
        return [(0, head),
                (self.layout["reqs"], ctypes.sizeof(structs.Req) * n_chunks),
                (self.layout["kv_tables"], 4 * self.max_blocks * n_chunks)]


class Launcher(Protocol):
    buffers: object      # the graphs' step.StaticBuffers (seats, logprob outputs); None for the echo stand-in

    def launch(self, graph: int, n_chunks: int) -> None:
        """Make the block's inputs visible to graph `graph`, run it, and leave the sampled
        tokens in block.step_tokens[:n_chunks] when this returns."""
        ...


def needs_seat(params) -> bool:
    """Whether a request's sampling keeps state on the device (sampler.SeatState)."""
    return bool(params.penalized or params.logit_bias or params.allowed_token_ids or params.bad_words)


class SeatTable:
    """The host loop's sampler seats: seat i belongs to at most one live Sequence. A seat
    comes back once its sequence holds no KV blocks (finished, aborted, or preempted: it
    is filled again from its output when it returns) or is gone; the engine runs at most
    max_batch_size sequences, one seat each, so a step always finds one."""

    def __init__(self, seats):
        self.state = seats                                   # sampler.SeatState (the graphs')
        self._owner: list[weakref.ref | None] = [None] * seats.seats
        self._of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # Sequence -> seat
        self.fills = 0

    def seat(self, seq) -> int:
        """seq's seat, taken and filled now if it holds none."""
        got = self._of.get(seq)
        if got is not None and self._owner[got] is not None and self._owner[got]() is seq:
            return got
        for i, ref in enumerate(self._owner):
            owner = ref() if ref is not None else None
            if owner is None or (not owner.blocks and owner is not seq):
                if owner is not None:
                    self._of.pop(owner, None)
                p = seq.params
                self.state.fill(i, seq.prompt, seq.output, p.logit_bias, p.allowed_token_ids, p.bad_words)
                self._owner[i], self._of[seq] = weakref.ref(seq), i
                self.fills += 1
                return i
        raise RuntimeError(f"all {len(self._owner)} sampler seats are held by running sequences")


class HostLoopRunner:
    """engine.Runner: reassembles each step's batch on the host and launches one graph."""

    def __init__(self, ring: Ring, block: StepBlock, launcher: Launcher, table: BucketTable | None):
        self.ring, self.block, self.launcher, self.table = ring, block, launcher, table
        self._seeds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # Sequence -> derived seed
        self._offsets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> arena offsets
        self.graph_steps = np.zeros(len(table.shapes) if table else 1, np.int64)
        buffers = getattr(launcher, "buffers", None)
        self.seats = SeatTable(buffers.seats) if buffers is not None else None

    def _seed(self, seq) -> int:
        if seq.params.seed is not None:
            return seq.params.seed & (2**64 - 1)
        if seq not in self._seeds:
            self._seeds[seq] = int.from_bytes(os.urandom(8), "little")
        return self._seeds[seq]

    def _arena_offsets(self, seq) -> tuple[int, int]:
        """(prompt, output) arena offsets read once from the slot and bounds-checked: the graph
        reads token ids there at every step, and a slot the frontend rewrites later must not
        move those reads outside the arenas."""
        got = self._offsets.get(seq)
        if got is None:
            rec, g = self.ring.slots[seq.slot], self.ring.geom
            got = int(rec["prompt_offset"]), int(rec["output_offset"])
            if got[0] + len(seq.prompt) > g.prompt_arena_tokens or got[1] + seq.max_tokens > g.output_arena_tokens:
                raise ValueError(f"slot {seq.slot}: arena offsets {got} out of range")
            self._offsets[seq] = got
        return got

    def run(self, batch: StepBatch) -> list[int]:
        from ..cuda import structs
        b, chunks = self.block, batch.chunks
        n = len(chunks)
        if n > b.max_chunks:
            raise RuntimeError(f"{n} chunks in one step, the block holds {b.max_chunks}")
        kind = KIND_PREFILL if batch.kind == StepKind.PREFILL else KIND_DECODE
        graph, rows = 0, []
        if self.table is not None:
            key = self.table.step_key(kind, [c.start for c in chunks], [c.num_tokens for c in chunks])
            graph = self.table.lookup(kind, *key)
            if not self.table.fits(graph, kind, *key):
                raise RuntimeError(f"step {key} fits no captured graph")
            rows = self.table.fill_rows([(i, c.start, c.num_tokens, c.sample) for i, c in enumerate(chunks)])
        for i, c in enumerate(chunks):
            s, r = c.seq, b.reqs[i]
            r.prompt_offset, r.output_offset = self._arena_offsets(s)
            r.prompt_len, r.generated = len(s.prompt), len(s.output)
            r.num_computed, r.num_blocks = s.num_computed, len(s.blocks)
            p = s.params
            r.temperature, r.top_p, r.top_k, r.min_p = p.temperature, p.top_p, p.top_k, p.min_p
            r.presence_penalty, r.frequency_penalty = p.presence_penalty, p.frequency_penalty
            r.repetition_penalty, r.min_tokens = p.repetition_penalty, p.min_tokens
            stops = sorted(s.stop_ids)[:structs.ROW_STOPS]       # the slot's stop ids + EOS unless ignore_eos
            r.n_mask_stops = len(stops)
            r.mask_stops[:len(stops)] = stops
            r.seat = self.seats.seat(s) if self.seats is not None and c.sample and needs_seat(p) else structs.NO_SEAT
            r.seed = self._seed(s)
            if self.table is not None:              # the echo stand-in reads no block tables
                if len(s.blocks) > b.max_blocks:
                    raise RuntimeError(f"slot {s.slot} holds {len(s.blocks)} blocks, tables hold {b.max_blocks}")
                b.tables[i, :len(s.blocks)] = s.blocks
            b.chunk_slot[i], b.chunk_sample[i] = i, int(c.sample)
        # the sampling row of a chunk asking logprobs: the graph computes its record (_logprobs reads it)
        rows = [(chunk, start, length, flags | ROW_LOGPROBS
                 if flags & ROW_SAMPLE and chunks[flags & ROW_CHUNK].seq.params.logprobs is not None else flags)
                for chunk, start, length, flags in rows]
        for j, (chunk, start, length, flags) in enumerate(rows):
            b.row_slot[j], b.row_start[j], b.row_len[j], b.row_flags[j] = chunk, start, length, flags
        st = b.state
        st.n_rows, st.n_chunks, st.graph = len(rows), n, graph
        st.step_no += 1
        self.launcher.launch(graph, n)
        self.graph_steps[graph] += 1
        self._logprobs(chunks, rows)
        return [int(b.step_tokens[i]) for i, c in enumerate(chunks) if c.sample]

    def timing(self) -> dict[str, int]:
        """The launcher's cumulative parts, ns (engine.Runner.timing): the copies and launch call,
        and the wait for the step; the rest of run() is this runner's staging."""
        return {k: getattr(self.launcher, k) for k in ("launch_ns", "wait_ns") if hasattr(self.launcher, k)}

    def _logprobs(self, chunks, rows) -> None:
        """Each sampling chunk that asks for logprobs: its row's record (the graph computed it: run
        marked the row ROW_LOGPROBS) into seq.step_logprobs, [1, 2 + 2k] int32 words."""
        for c in chunks:
            c.seq.step_logprobs = None
        want = {flags & ROW_CHUNK: j for j, (_, _, _, flags) in enumerate(rows) if flags & ROW_LOGPROBS}
        buffers = getattr(self.launcher, "buffers", None)
        if not want or buffers is None:      # the echo stand-in computes none: the engine writes blanks
            return
        lp, rank, ids, vals = buffers.logprob_rows(list(want.values()))
        for j, i in enumerate(want):
            k = chunks[i].seq.params.logprobs
            rec = np.empty((1, 2 + 2 * k), "<i4")
            rec[0, 0] = lp[j:j + 1].astype("<f4").view("<i4")[0]
            rec[0, 1] = rank[j]
            rec[0, 2:2 + k] = ids[j, :k]
            rec[0, 2 + k:] = vals[j, :k].astype("<f4").view("<i4")
            chunks[i].seq.step_logprobs = rec


class CpuLauncher:
    """The graphs on the CPU (cpu_graphs.CpuGraphs) over a StepBlock in host memory."""

    def __init__(self, graphs, block: StepBlock, ring: Ring):
        self.graphs = graphs
        self.buffers = graphs.buffers
        ring_addr = np.frombuffer(ring.buf, np.uint8).ctypes.data
        self.params = block.params(block.addr, ring_addr, ring)

    def launch(self, graph: int, n_chunks: int) -> None:
        if self.graphs.launch(ctypes.addressof(self.params), graph * 2) != 0:
            raise RuntimeError(f"graph {graph} failed")
