"""Capture planning and the executors' shared sizing: one set of static buffers
holds every graph's inputs, attention row groups respect the workspace,
capture goes largest first, the memory estimate grows with the grid; the flags
(and BLINK_GRAPH_BUCKETS / BLINK_GRAPH_BLAS) become one configuration, with one-line errors."""
from __future__ import annotations

import pytest
import torch

from gpu_backend.executors import ExecutorOptions
from gpu_backend.graphs.buckets import KIND_DECODE, KIND_PREFILL, BucketConfig, BucketTable
from gpu_backend.graphs.config import GraphConfigError, GraphExecConfig
from gpu_backend.graphs.device import smollm2_shape_config
from gpu_backend.graphs.plan import CapturePlan
from gpu_backend.graphs.step import StaticBuffers
from gpu_backend.model import tiny_config

SMOL = smollm2_shape_config()


def _plan(**kw) -> CapturePlan:
    cfg = dict(max_batch_size=64, max_prefill_tokens=1024, max_model_len=1024, block_size=16, split_len=256)
    cfg.update(kw)
    return CapturePlan(BucketTable(BucketConfig(**cfg)), SMOL)


def test_static_buffers_hold_every_shape():
    plan = _plan()
    sizes = plan.static_sizes()
    for g in plan.table.shapes:
        assert g.tokens <= sizes.tokens and g.rows <= sizes.rows and g.rows * g.ctx // 16 <= sizes.table
    assert sizes.tokens == max(g.tokens for g in plan.table.shapes)
    b = StaticBuffers(sizes, "cpu")
    assert b.input_ids.numel() == sizes.tokens and b.tokens.numel() == sizes.rows
    assert b.nbytes == sizes.nbytes()


def test_row_groups_bound_the_attention_workspace():
    plan = CapturePlan(_plan().table, SMOL, attn_workspace_bytes=64 << 20)
    for g in plan.table.shapes:
        grp = plan.row_group(g)
        assert 1 <= grp <= g.rows
        assert grp == 1 or grp * 2 * 4 * SMOL.num_heads * g.len * g.ctx <= 64 << 20
    big = max(plan.table.shapes, key=lambda g: g.tokens * g.ctx)
    assert plan.row_group(big) < big.rows


def test_capture_order_is_largest_first_and_complete():
    plan = _plan()
    order = plan.capture_order()
    assert sorted(order) == list(range(len(plan.table.shapes)))
    acts = [plan.activation_bytes(plan.table.shapes[i]) for i in order]
    assert acts == sorted(acts, reverse=True)


def test_memory_estimate_grows_with_the_grid():
    small = _plan(decode_rows=(1, 64), prefill_rows=(1, 16)).memory_estimate()
    full = _plan().memory_estimate()
    assert full.exec_bytes > small.exec_bytes and full.total_bytes > small.total_bytes > 0
    assert "prefill" in full.largest and full.as_dict()["total_bytes"] == full.total_bytes


def test_executor_config_from_flags(monkeypatch):
    monkeypatch.delenv("BLINK_GRAPH_BUCKETS", raising=False)
    monkeypatch.delenv("BLINK_GRAPH_BLAS", raising=False)
    g = GraphExecConfig.from_options(ExecutorOptions(model="x", max_batch_size=128, max_model_len=1000,
                                                     kv_cache_mb=4096), SMOL)
    assert g.policy.max_batch_size == 128 and g.max_model_len == 1000 and g.blas is None
    assert g.num_blocks == (4096 << 20) // (2 * 30 * 16 * 3 * 64 * 4)
    t = BucketTable(g.buckets)
    assert {s.ctx for s in t.shapes if s.kind == KIND_DECODE} == {128, 256, 512, 1024}
    assert {s.ctx for s in t.shapes if s.kind == KIND_PREFILL} == {512, 1024}
    monkeypatch.setenv("BLINK_GRAPH_BUCKETS", '{"decode_rows": [1, 128], "prefill_rows": [4]}')
    monkeypatch.setenv("BLINK_GRAPH_BLAS", "cublas")
    g = GraphExecConfig.from_options(ExecutorOptions(model="x", max_batch_size=128, max_model_len=1000), SMOL)
    t = BucketTable(g.buckets)
    assert {s.rows for s in t.shapes if s.kind == KIND_DECODE} == {1, 128} and g.blas == "cublas"
    assert {s.rows for s in t.shapes if s.kind == KIND_PREFILL} == {4, t.config.prefill_max_rows}


@pytest.mark.parametrize("env, value, match", [
    ("BLINK_GRAPH_BUCKETS", "{not json", "not JSON"),
    ("BLINK_GRAPH_BUCKETS", '{"bogus": 1}', "keys from"),
    ("BLINK_GRAPH_BUCKETS", '{"len_granularity": 0}', "graph buckets"),
    ("BLINK_GRAPH_BLAS", "magma", "cublas or cublaslt"),
])
def test_bad_environment_is_a_one_line_error(monkeypatch, env, value, match):
    monkeypatch.setenv(env, value)
    with pytest.raises(GraphConfigError, match=match) as e:
        GraphExecConfig.from_options(ExecutorOptions(model="x"), tiny_config())
    assert "\n" not in str(e.value)


def test_a_pool_too_small_for_a_block_is_refused(monkeypatch):
    monkeypatch.delenv("BLINK_GRAPH_BUCKETS", raising=False)
    big = smollm2_shape_config()
    with pytest.raises(GraphConfigError, match="holds no"):
        GraphExecConfig.from_options(ExecutorOptions(model="x", kv_cache_mb=1, block_size=64), big)   # 2.9 MB blocks


def test_context_capped_by_the_pool(monkeypatch):
    monkeypatch.delenv("BLINK_GRAPH_BUCKETS", raising=False)
    cfg = tiny_config(num_layers=4, num_heads=4, num_kv_heads=4, head_dim=64)      # 32 KiB blocks of 4
    g = GraphExecConfig.from_options(ExecutorOptions(model="x", block_size=4, kv_cache_mb=1), cfg)
    assert g.num_blocks == 32 and g.max_model_len == 128
    assert g.dtype == torch.float32
