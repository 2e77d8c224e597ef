"""bench.cuda_draw, the draw's table in the plan's graphs call: on the CPU under Triton's interpreter
(a small vocabulary), every mix gives both draws' tokens, the same ones, none outside the filters,
and the table renders; without Triton only the PyTorch columns run."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"      # before the kernels are decorated (their module's import)
pytest.importorskip("triton")

from bench import cuda_draw  # noqa: E402


def test_every_mix_draws_the_references_tokens_and_the_table_renders():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    table = cuda_draw.draw_table(device, 257, [3, 1, 3], runs=1, triton=True)
    assert [(r["rows"], r["mix"]) for r in table] == [(n, m) for n in (1, 3) for m in cuda_draw.MIXES]
    for r in table:
        assert "triton_error" not in r, r
        assert r["outside"] == 0 and r["agree"] == 1.0 and r["pipelined_same"], r
        assert r["triton_ms"] > 0 and r["torch_ms"] > 0 and r["sort_ms"] > 0 and r["pipelined_ms"] > 0
    md = cuda_draw.markdown(table)
    assert sum(line.startswith("| 3 | ") for line in md) == len(cuda_draw.MIXES)


def test_without_triton_only_the_pytorch_columns_run():
    table = cuda_draw.draw_table("cpu", 64, [2], runs=1, triton=False)
    assert all("triton_ms" not in r and r["torch_ms"] > 0 for r in table)
    assert "| 2 | greedy | - |" in "\n".join(cuda_draw.markdown(table))


def test_the_logprobs_table_compares_the_fused_records_with_pytorchs():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    table = cuda_draw.logprobs_table(device, 1100, [2, 1], runs=1, triton=True)
    assert [r["rows"] for r in table] == [1, 2]
    assert all(r["same_ranks_ids"] and r["max_value_diff"] < 1e-5 and r["triton_ms"] > 0 for r in table), table
    assert all(r["every_tile_same"] and r["every_tile_ms"] > 0 and r["rank_ties"] == 0 for r in table), table
    assert sum(line.startswith("| 2 | ") for line in cuda_draw.logprobs_markdown(table)) == 1


def test_main_writes_both_tables_named_by_the_machine(tmp_path, capsys):
    assert cuda_draw.main(["--rows", "1", "--vocab", "64", "--runs", "1", "--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    machine = "cpu" if not torch.cuda.is_available() else names[0].split("-")[3]
    assert names == [f"{names[0][:10]}-{machine}-cuda_draw.json", f"{names[0][:10]}-{machine}-cuda_draw.md"]
    assert "Reproduce: `python -m bench.cuda_draw --rows 1 --vocab 64 --runs 1`." in (tmp_path / names[1]).read_text()
