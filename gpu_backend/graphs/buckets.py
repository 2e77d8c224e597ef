"""Bucket tables: which step graphs exist and which one serves a step, in O(1).

    BucketConfig (policy limits, grids) -> GraphShape list (prefill grid over
    rows x row length x context, decode grid over rows x context, each kind's
    max shape included as its fallback)
      -> BucketTable: dense lookup arrays [rows + 1, len cells, ctx cells] -> graph
         id of the tightest graph covering the cell (fewest padded tokens, then
         the shortest context), built once by brute force over every cell
      -> step_key(chunks) / lookup(key) / fill_rows(chunks): the Python twin of
         csrc/graph_table.h (diff-tested), used by the host loop
      -> device_arrays() / c_source(): the same tables for the device scheduler

A graph of shape (rows R, len S, ctx C) runs R rows of S query tokens, each
against up to C cached tokens (C a multiple of the block size). A prefill step
whose chunks are all at most `split_len` long is one row per chunk (len = the
longest chunk); longer chunks are cut into rows of `split_len` tokens, so the
padded size stays near the step's real token count whatever the mix. Decode
graphs have S = 1 and one row per request.
"""
from __future__ import annotations

import dataclasses

import numpy as np

KIND_PREFILL = 1       # = structs.STEP_PREFILL (csrc BLINK_GRAPH_KIND_PREFILL)
KIND_DECODE = 2        # = structs.STEP_DECODE
KIND_NAMES = {KIND_PREFILL: "prefill", KIND_DECODE: "decode"}
ROW_SAMPLE, ROW_LOGPROBS, ROW_CHUNK = 0x8000_0000, 0x4000_0000, 0x3FFF_FFFF
MAX_GRAPHS = 0xFFFF    # ids are uint16 in the tables


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, x = [], 1
    while x < hi:
        if x >= lo:
            out.append(x)
        x *= 2
    return sorted(set(out + [hi]))


@dataclasses.dataclass(frozen=True)
class GraphShape:
    kind: int
    rows: int
    len: int      # query tokens per row
    ctx: int      # cached tokens per row the attention may read

    @property
    def tokens(self) -> int:
        return self.rows * self.len

    def covers(self, rows: int, len_: int, ctx: int) -> bool:
        return rows <= self.rows and len_ <= self.len and ctx <= self.ctx

    def __str__(self) -> str:
        return f"{KIND_NAMES[self.kind]}[{self.rows}x{self.len}, ctx {self.ctx}]"


@dataclasses.dataclass(frozen=True)
class BucketConfig:
    """Grids of the graph cache. Empty grids get defaults (powers of two up to each kind's
    maximum); every grid gets its maximum added, so each kind's max shape exists."""
    max_batch_size: int
    max_prefill_tokens: int
    max_model_len: int
    block_size: int = 16
    split_len: int = 512              # prefill rows hold at most this many tokens (rounded down to len_granularity)
    len_granularity: int = 16         # prefill row-length cell size
    ctx_granularity: int = 0          # context cell size, a multiple of block_size (0: block_size)
    prefill_rows: tuple[int, ...] = ()
    prefill_lens: tuple[int, ...] = ()
    prefill_ctxs: tuple[int, ...] = ()    # default: only the max context (prefill attends over the full table)
    decode_rows: tuple[int, ...] = ()
    decode_ctxs: tuple[int, ...] = ()     # default: 4 contexts up to the max, in whole blocks
    max_graph_tokens: int = 0             # drop prefill graphs of more padded tokens (the fallback stays); 0: keep all

    def __post_init__(self):
        for name in ("max_batch_size", "max_prefill_tokens", "max_model_len", "block_size", "split_len",
                     "len_granularity"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"BucketConfig.{name} must be a positive integer, got {v!r}")
        if self.ctx_granularity < 0 or self.ctx_granularity % self.block_size:
            raise ValueError(f"ctx_granularity ({self.ctx_granularity}) must be a multiple of the block size "
                             f"({self.block_size})")
        for name in ("prefill_rows", "prefill_lens", "prefill_ctxs", "decode_rows", "decode_ctxs"):
            if any(not isinstance(v, int) or v <= 0 for v in getattr(self, name)):
                raise ValueError(f"BucketConfig.{name} must hold positive integers, got {getattr(self, name)}")

    # -- the maxima every step stays within ---------------------------------------
    @property
    def split(self) -> int:
        """Row length cap of prefill (no chunk is ever longer than the prefill budget)."""
        s = min(self.split_len, self.max_prefill_tokens)
        return s - s % self.len_granularity if s >= self.len_granularity else self.len_granularity

    @property
    def ctx_cell(self) -> int:
        return self.ctx_granularity or self.block_size

    @property
    def max_ctx(self) -> int:
        """Context of the largest graph: one max_model_len context, in whole context cells."""
        return _ceil_div(self.max_model_len, self.ctx_cell) * self.ctx_cell

    @property
    def prefill_max_rows(self) -> int:
        """Rows of the largest prefill step: one per chunk (at most a seat each, and at
        least a token each), plus one per split_len tokens when chunks are cut."""
        chunks = min(self.max_batch_size, self.max_prefill_tokens)
        return min(self.max_prefill_tokens, chunks + _ceil_div(self.max_prefill_tokens, self.split))

    def _ctx_grid(self, given: tuple[int, ...], default: list[int]) -> list[int]:
        cell = self.ctx_cell
        vals = {min(self.max_ctx, _ceil_div(v, cell) * cell) for v in (given or default)}
        return sorted(vals | {self.max_ctx})

    def shapes(self) -> list[GraphShape]:
        """Every graph of the cache, prefill then decode, each grid in increasing order."""
        p_rows = sorted(set(self.prefill_rows or _powers_of_two(1, self.prefill_max_rows)) | {self.prefill_max_rows})
        p_rows = [r for r in p_rows if r <= self.prefill_max_rows]
        lens = sorted({min(self.split, _ceil_div(v, self.len_granularity) * self.len_granularity)
                       for v in (self.prefill_lens or _powers_of_two(self.len_granularity, self.split))}
                      | {self.split})
        p_ctx = self._ctx_grid(self.prefill_ctxs, [self.max_ctx])
        d_rows = sorted(set(self.decode_rows or _powers_of_two(1, self.max_batch_size)) | {self.max_batch_size})
        d_rows = [r for r in d_rows if r <= self.max_batch_size]
        d_ctx = self._ctx_grid(self.decode_ctxs, [self.max_ctx // 8, self.max_ctx // 4, self.max_ctx // 2])
        out = []
        for r in p_rows:
            for s in lens:
                for c in p_ctx:
                    g = GraphShape(KIND_PREFILL, r, s, max(c, self.ctx_cell))
                    fallback = (r, s, c) == (self.prefill_max_rows, self.split, self.max_ctx)
                    if fallback or not self.max_graph_tokens or g.tokens <= self.max_graph_tokens:
                        out.append(g)
        for r in d_rows:
            for c in d_ctx:
                out.append(GraphShape(KIND_DECODE, r, 1, max(c, self.ctx_cell)))
        if len(out) > MAX_GRAPHS:
            raise ValueError(f"{len(out)} graphs: at most {MAX_GRAPHS}")
        return out


@dataclasses.dataclass(frozen=True)
class Lut:
    """One kind's dense table: ids[rows, len cell, ctx cell] -> graph id."""
    ids: np.ndarray           # [max_rows + 1, n_len, n_ctx] uint16
    len_granularity: int
    ctx_granularity: int
    fallback: int

    @property
    def max_rows(self) -> int:
        return self.ids.shape[0] - 1


class BucketTable:
    def __init__(self, config: BucketConfig):
        self.config = config
        self.shapes: list[GraphShape] = config.shapes()
        self.luts = {KIND_PREFILL: self._build(KIND_PREFILL), KIND_DECODE: self._build(KIND_DECODE)}

    def _build(self, kind: int) -> Lut:
        cfg = self.config
        ids = [i for i, g in enumerate(self.shapes) if g.kind == kind]
        gs = [self.shapes[i] for i in ids]
        max_rows = max(g.rows for g in gs)
        lg = cfg.len_granularity if kind == KIND_PREFILL else 1
        n_len = _ceil_div(cfg.split, lg) + 1 if kind == KIND_PREFILL else 1
        cg = cfg.ctx_cell
        n_ctx = _ceil_div(cfg.max_ctx, cg) + 1
        fallback = max(ids, key=lambda i: (self.shapes[i].tokens, self.shapes[i].ctx, self.shapes[i].rows))
        # cell (r, lc, cc) holds every key with rows == r, len <= lc * lg, ctx <= cc * cg
        r = np.arange(max_rows + 1)[:, None, None]
        lmax = (np.arange(n_len) * lg)[None, :, None] if kind == KIND_PREFILL else np.ones((1, 1, 1), np.int64)
        cmax = (np.arange(n_ctx) * cg)[None, None, :]
        best = np.full((max_rows + 1, n_len, n_ctx), fallback, np.int64)
        best_cost = np.full(best.shape, np.iinfo(np.int64).max, np.int64)
        for i, g in zip(ids, gs):
            covers = (r <= g.rows) & (lmax <= g.len) & (cmax <= g.ctx)
            cost = g.tokens * (cfg.max_ctx + 1) + g.ctx       # padded tokens first, then the context
            better = covers & (cost < best_cost)
            best = np.where(better, i, best)
            best_cost = np.where(better, cost, best_cost)
        return Lut(best.astype(np.uint16), lg, cg, fallback)

    # -- the Python twin of graph_table.h ------------------------------------------
    def step_key(self, kind: int, starts, lens) -> tuple[int, int, int]:
        """(rows, len, ctx) of a step whose chunks start at `starts` and compute `lens` tokens."""
        ctx = max((s + n for s, n in zip(starts, lens)), default=0)
        longest = max(lens, default=0)
        split = self.config.split
        if kind == KIND_DECODE or longest <= split:
            return len(lens), longest, ctx
        return sum(_ceil_div(n, split) for n in lens), split, ctx

    def lookup(self, kind: int, rows: int, len_: int, ctx: int) -> int:
        """The graph id for a step key: one index into the kind's table."""
        t = self.luts[kind]
        lc = 0 if t.ids.shape[1] == 1 else _ceil_div(len_, t.len_granularity)
        cc = _ceil_div(ctx, t.ctx_granularity)
        if rows > t.max_rows or lc >= t.ids.shape[1] or cc >= t.ids.shape[2]:
            return t.fallback
        return int(t.ids[rows, lc, cc])

    def fits(self, graph: int, kind: int, rows: int, len_: int, ctx: int) -> bool:
        g = self.shapes[graph]
        return g.kind == kind and g.covers(rows, len_, ctx)

    def fill_rows(self, chunks) -> list[tuple[int, int, int, int]]:
        """chunks: (slot, start, len, sample) -> rows (slot, start, len, flags), pieces of at most
        split_len tokens; flags = chunk index | ROW_SAMPLE on the last piece of a sampling chunk."""
        split, rows = self.config.split, []
        for c, (slot, start, n, sample) in enumerate(chunks):
            off = 0
            while True:
                piece = min(split, n - off)
                off += piece
                rows.append((slot, start + off - piece, piece, c | (ROW_SAMPLE if off == n and sample else 0)))
                if off >= n:
                    break
        return rows

    # -- what the device and the host loop need ----------------------------------------
    @property
    def max_rows(self) -> int:
        return max(g.rows for g in self.shapes)

    def device_arrays(self) -> dict[str, np.ndarray]:
        """The arrays the scheduler reads: shapes [n * 4] uint32 (kind, rows, len, ctx), and each
        kind's table, flattened in (rows, len cell, ctx cell) order."""
        shapes = np.array([(g.kind, g.rows, g.len, g.ctx) for g in self.shapes], np.uint32).reshape(-1)
        return {"shapes": shapes, "prefill": np.ascontiguousarray(self.luts[KIND_PREFILL].ids.reshape(-1)),
                "decode": np.ascontiguousarray(self.luts[KIND_DECODE].ids.reshape(-1))}

    def graph_table(self, execs: int, shapes: int, prefill: int, decode: int):
        """structs.GraphTable for arrays (device_arrays()) at the given addresses."""
        from ..cuda import structs
        t = structs.GraphTable(execs=execs, shapes=shapes, n_graphs=len(self.shapes), split_len=self.config.split)
        for name, addr in (("prefill", prefill), ("decode", decode)):
            lut = self.luts[KIND_PREFILL if name == "prefill" else KIND_DECODE]
            setattr(t, name, structs.GraphLut(ids=addr, max_rows=lut.max_rows, n_len=lut.ids.shape[1],
                                              n_ctx=lut.ids.shape[2], len_granularity=lut.len_granularity,
                                              ctx_granularity=lut.ctx_granularity, fallback=lut.fallback))
        return t

    def c_source(self, name: str = "blink_graphs") -> str:
        """The tables as a C translation unit defining `const blink_graph_table_t <name>` (execs
        NULL): the device scheduler's view, for builds that bake one configuration in."""
        arrs = self.device_arrays()

        def arr(ctype: str, suffix: str, a: np.ndarray) -> str:
            body = ",".join(str(int(v)) for v in a.tolist())
            return f"static const {ctype} {name}_{suffix}[{max(1, a.size)}] = {{{body or '0'}}};"

        def lut(kind: int, suffix: str) -> str:
            t = self.luts[kind]
            return (f"{{{name}_{suffix}, {t.max_rows}u, {t.ids.shape[1]}u, {t.ids.shape[2]}u, "
                    f"{t.len_granularity}u, {t.ctx_granularity}u, {t.fallback}u}}")

        return "\n".join([
            f"/* Generated by gpu_backend.graphs.buckets.BucketTable.c_source: {len(self.shapes)} graphs. */",
            '#include "graph_table.h"',
            arr("uint32_t", "shapes", arrs["shapes"]),
            arr("uint16_t", "prefill", arrs["prefill"]),
            arr("uint16_t", "decode", arrs["decode"]),
            f"extern const blink_graph_table_t {name};   /* external linkage in C++ too */",
            f"const blink_graph_table_t {name} = {{0, {name}_shapes, {lut(KIND_PREFILL, 'prefill')}, "
            f"{lut(KIND_DECODE, 'decode')}, {len(self.shapes)}u, {self.config.split}u}};",
            ""])

    def describe(self) -> dict:
        per_kind = {KIND_NAMES[k]: sum(g.kind == k for g in self.shapes) for k in KIND_NAMES}
        return {"graphs": len(self.shapes), **per_kind, "max_rows": self.max_rows, "split_len": self.config.split,
                "prefill_fallback": str(self.shapes[self.luts[KIND_PREFILL].fallback]),
                "decode_fallback": str(self.shapes[self.luts[KIND_DECODE].fallback]),
                "lut_bytes": sum(t.ids.nbytes for t in self.luts.values())}
