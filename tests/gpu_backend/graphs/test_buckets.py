"""Bucket tables: the O(1) lookup gives the tightest captured graph for every
step key (checked against a brute-force search), each kind's max shape catches
everything else, and the device's C (csrc/graph_table.h, through the g++ twin
library, and the emitted C table compiled on its own) agrees with the Python."""
from __future__ import annotations

import ctypes
import random
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_backend.cuda import build
from gpu_backend.graphs.buckets import (KIND_DECODE, KIND_PREFILL, ROW_SAMPLE, BucketConfig, BucketTable,
                                        GraphShape)

SMALL = BucketConfig(max_batch_size=8, max_prefill_tokens=96, max_model_len=200, block_size=4, split_len=32,
                     len_granularity=8, ctx_granularity=8)


def _brute(table: BucketTable, kind: int, rows: int, len_: int, ctx: int) -> int:
    """The tightest graph of the kind covering the key, by the table's own cost order (cell-rounded)."""
    cfg, t = table.config, table.luts[kind]
    lc = 0 if t.ids.shape[1] == 1 else -(-len_ // t.len_granularity)
    cc = -(-ctx // t.ctx_granularity)
    if rows > t.max_rows or lc >= t.ids.shape[1] or cc >= t.ids.shape[2]:
        return t.fallback
    cand = [i for i, g in enumerate(table.shapes) if g.kind == kind and rows <= g.rows
            and (kind == KIND_DECODE or lc * t.len_granularity <= g.len) and cc * t.ctx_granularity <= g.ctx]
    if not cand:
        return t.fallback
    return min(cand, key=lambda i: (table.shapes[i].tokens * (cfg.max_ctx + 1) + table.shapes[i].ctx, i))


def test_default_grids_and_maxima():
    t = BucketTable(BucketConfig(max_batch_size=256, max_prefill_tokens=2048, max_model_len=1024))
    d = t.describe()
    assert d["prefill_fallback"] == "prefill[260x512, ctx 1024]"     # 256 chunks + 2048 / 512 split rows
    assert d["decode_fallback"] == "decode[256x1, ctx 1024]"
    shapes = t.shapes
    assert {g.len for g in shapes if g.kind == KIND_PREFILL} == {16, 32, 64, 128, 256, 512}
    assert {g.ctx for g in shapes if g.kind == KIND_DECODE} == {128, 256, 512, 1024}
    assert {g.rows for g in shapes if g.kind == KIND_DECODE} == {1, 2, 4, 8, 16, 32, 64, 128, 256}
    assert len(set(shapes)) == len(shapes)


def test_every_cell_is_the_tightest_covering_graph():
    t = BucketTable(SMALL)
    for kind in (KIND_PREFILL, KIND_DECODE):
        lut = t.luts[kind]
        for rows in range(lut.max_rows + 2):
            for len_ in ([1] if kind == KIND_DECODE else range(1, t.config.split + 2)):
                for ctx in range(0, t.config.max_ctx + 10, 3):
                    got = t.lookup(kind, rows, len_, ctx)
                    assert got == _brute(t, kind, rows, len_, ctx), (kind, rows, len_, ctx)
                    g = t.shapes[got]
                    assert g.kind == kind
                    if rows <= lut.max_rows and len_ <= t.config.split and ctx <= t.config.max_ctx:
                        assert g.covers(rows, len_, ctx)


def test_pruned_grid_falls_back_to_the_max_shape():
    cfg = BucketConfig(max_batch_size=8, max_prefill_tokens=96, max_model_len=200, block_size=4, split_len=32,
                       len_granularity=8, max_graph_tokens=64)
    t = BucketTable(cfg)
    fb = t.shapes[t.luts[KIND_PREFILL].fallback]
    assert fb.tokens > 64 and all(g.tokens <= 64 or g == fb for g in t.shapes if g.kind == KIND_PREFILL)
    assert t.lookup(KIND_PREFILL, 8, 32, 100) == t.luts[KIND_PREFILL].fallback
    assert t.shapes[t.lookup(KIND_PREFILL, 2, 32, 100)].tokens == 64


def test_step_key_and_rows():
    t = BucketTable(SMALL)
    assert t.step_key(KIND_DECODE, [5, 9, 0], [1, 1, 1]) == (3, 1, 10)
    assert t.step_key(KIND_PREFILL, [0, 3], [20, 7]) == (2, 20, 20)
    # a chunk longer than split_len (32): every chunk cut into rows of 32
    assert t.step_key(KIND_PREFILL, [0, 10, 0], [70, 5, 32]) == (3 + 1 + 1, 32, 70)
    rows = t.fill_rows([(7, 0, 70, True), (3, 10, 5, False), (1, 0, 32, True)])
    assert rows == [(7, 0, 32, 0), (7, 32, 32, 0), (7, 64, 6, 0 | ROW_SAMPLE), (3, 10, 5, 1),
                    (1, 0, 32, 2 | ROW_SAMPLE)]


def test_invalid_configs_are_clear_errors():
    with pytest.raises(ValueError, match="max_batch_size"):
        BucketConfig(max_batch_size=0, max_prefill_tokens=8, max_model_len=8)
    with pytest.raises(ValueError, match="multiple of the block size"):
        BucketConfig(max_batch_size=2, max_prefill_tokens=8, max_model_len=8, block_size=16, ctx_granularity=24)
    with pytest.raises(ValueError, match="decode_rows"):
        BucketConfig(max_batch_size=2, max_prefill_tokens=8, max_model_len=8, decode_rows=(0,))


# -- the C side ------------------------------------------------------------------------------

class CTable:
    """The table in host memory as the C functions read it."""

    def __init__(self, table: BucketTable):
        self.arrays = table.device_arrays()
        a = self.arrays
        self.gt = table.graph_table(0, a["shapes"].ctypes.data, a["prefill"].ctypes.data, a["decode"].ctypes.data)


def _c_key(lib, ct, kind, starts, lens):
    s, n = np.array(starts, np.uint32), np.array(lens, np.uint32)
    out = np.zeros(3, np.uint32)
    lib.blink_step_key_c(ctypes.byref(ct.gt), kind, s.ctypes.data, n.ctypes.data, len(s), out.ctypes.data)
    return tuple(int(x) for x in out)


def test_c_lookup_key_and_rows_match_python(twin_lib):
    t = BucketTable(SMALL)
    ct = CTable(t)
    rng = random.Random(5)
    for _ in range(3000):
        kind = rng.choice([KIND_PREFILL, KIND_DECODE])
        n = rng.randint(1, 8)
        lens = [1] * n if kind == KIND_DECODE else [rng.choice([1, 2, 7, 8, 9, 31, 32, 33, 70, 96]) for _ in range(n)]
        starts = [rng.randint(0, 100) for _ in range(n)]
        key = t.step_key(kind, starts, lens)
        assert _c_key(twin_lib, ct, kind, starts, lens) == key
        gid = t.lookup(kind, *key)
        assert twin_lib.blink_graph_lookup_c(ctypes.byref(ct.gt), kind, *key) == gid
        assert bool(twin_lib.blink_graph_fits_c(ctypes.byref(ct.gt), gid, kind, *key)) == t.fits(gid, kind, *key)
        sample = [rng.random() < 0.5 for _ in range(n)]
        slots = [rng.randrange(64) for _ in range(n)]
        want = t.fill_rows(list(zip(slots, starts, lens, sample)))
        cap = 64
        outs = [np.zeros(cap, np.uint32) for _ in range(4)]
        cols = [np.array(x, np.uint32) for x in (slots, starts, lens, [int(x) for x in sample])]
        nr = twin_lib.blink_fill_rows_c(t.config.split, *(c.ctypes.data for c in cols), n,
                                        *(o.ctypes.data for o in outs))
        assert nr == len(want) == key[0] or kind == KIND_DECODE
        assert [tuple(int(o[i]) for o in outs) for i in range(nr)] == want


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 40), len_=st.integers(0, 40), ctx=st.integers(0, 260),
       kind=st.sampled_from([KIND_PREFILL, KIND_DECODE]))
def test_hypothesis_c_lookup_matches(twin_lib, rows, len_, ctx, kind):
    t = _hyp_table()
    ct = _hyp_ctable()
    assert twin_lib.blink_graph_lookup_c(ctypes.byref(ct.gt), kind, rows, len_, ctx) == t.lookup(kind, rows, len_, ctx)


_CACHE = {}


def _hyp_table():
    if "t" not in _CACHE:
        _CACHE["t"] = BucketTable(SMALL)
    return _CACHE["t"]


def _hyp_ctable():
    if "c" not in _CACHE:
        _CACHE["c"] = CTable(_hyp_table())
    return _CACHE["c"]


def test_emitted_c_table_compiles_and_agrees(tmp_path):
    """c_source() is a valid C translation unit whose table gives the Python's answers."""
    gxx = build.find_gxx()
    if gxx is None:
        pytest.skip("no g++")
    t = BucketTable(SMALL)
    (tmp_path / "table.c").write_text(t.c_source("tbl"))
    queries = [(k, r, n, c) for k in (KIND_PREFILL, KIND_DECODE) for r in range(0, 12, 3)
               for n in (1, 8, 9, 32, 40) for c in (0, 7, 64, 199, 400)]
    main = ['#include "graph_table.h"', "#include <stdio.h>", "extern const blink_graph_table_t tbl;",
            "int main(void) {", "  static const unsigned q[][4] = {"]
    main += [f"    {{{k}u, {r}u, {n}u, {c}u}}," for k, r, n, c in queries]
    main += ["  };", "  for (unsigned i = 0; i < sizeof q / sizeof q[0]; ++i)",
             '    printf("%u\\n", blink_graph_lookup(&tbl, q[i][0], q[i][1], q[i][2], q[i][3]));', "  return 0;", "}"]
    (tmp_path / "main.c").write_text("\n".join(main) + "\n")
    exe = tmp_path / "lookup"
    subprocess.run([gxx, "-x", "c++", "-std=c++17", f"-I{build.CSRC}", f"-I{build.LAYOUT_INCLUDE}",
                    str(tmp_path / "table.c"), str(tmp_path / "main.c"), "-o", str(exe)], check=True,
                   capture_output=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    assert [int(x) for x in out] == [t.lookup(*q) for q in queries]


def test_graph_shape_str_and_cover():
    g = GraphShape(KIND_PREFILL, 4, 32, 64)
    assert str(g) == "prefill[4x32, ctx 64]" and g.tokens == 128
    assert g.covers(4, 32, 64) and not g.covers(5, 1, 1) and not g.covers(1, 33, 1) and not g.covers(1, 1, 65)
