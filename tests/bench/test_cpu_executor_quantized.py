"""bench.cpu_executor on a tiny GGUF with quantized matrices: the executor on the GGUF's blocks
is measured beside the float executor in the same run, and the CPU is named."""
from __future__ import annotations

import json

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from bench import cpu_executor
from gpu_backend import cpu_kernels
from gpu_backend.model import LlamaModel, tiny_config
from gpu_backend.model.gguf_weights import write_gguf
from gpu_backend.model.loader import hf_state_dict


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels cannot be built here (no g++)")
def test_the_quantized_executor_is_measured_beside_the_float_one(tmp_path):
    config = tiny_config(head_dim=16, hidden_size=64, intermediate_size=128)
    tensors = hf_state_dict(LlamaModel.random(config, seed=2))
    path = tmp_path / "tiny.gguf"
    write_gguf(path, config, tensors, types={n: Q.Q4_1 for n in tensors if n.endswith("_proj.weight")})
    threads = torch.get_num_threads()
    try:
        assert cpu_executor.main(["--model", str(path), "--threads", "1", "--batches", "1,2", "--prompts", "8",
                                  "--decode-tokens", "4", "--reps", "1", "--date", "2000-01-01", "--machine", "t",
                                  "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    r = json.loads((tmp_path / "2000-01-01-t-cpu_executor.json").read_text())
    q = r["executor_quantized"]
    assert q["weights"] == ["Q4_1"] and q["decode_tok_s"]["2"] > 0 and q["ttft_s"]["8"] > 0
    assert r["ratios"]["decode_quantized_vs_executor"]["1"] > 0
    assert r["host"]["cpu"]["quant_isa"] in cpu_kernels.ISA_NAMES
    bw = r["bandwidth"]
    assert bw["triad_gb_s"] > 0
    # the blocks are ~5/8 of a byte a weight (Q4_1: 20 bytes per 32), the float executor's 4 bytes
    assert bw["weight_mb_per_token"]["executor_quantized"] < 0.5 * bw["weight_mb_per_token"]["executor"]
    assert bw["decode_1_fraction_of_bound"]["executor_quantized"] > 0
    md = (tmp_path / "2000-01-01-t-cpu_executor.md").read_text()
    assert "GGUF blocks served as such (Q4_1" in md and "CPU: " in md and "triad" in md


def test_weight_bytes_count_blocks_floats_and_a_tied_head_once():
    from bench.bandwidth import weight_bytes_per_token
    from gpu_backend.model.quantized import QuantLinear, QuantWeight
    model = LlamaModel.random(tiny_config(tie_word_embeddings=True), seed=0)
    floats = sum(p.numel() * 4 for n, p in model.named_parameters() if "embed" not in n)
    emb = model.embed_tokens.weight.numel() * 4
    assert weight_bytes_per_token(model) == floats + emb                  # the tied head reads the table
    blocks = torch.zeros(512, 40, dtype=torch.uint8)                       # 512 rows of 64 values, Q4_1
    model.logits_head = QuantLinear([QuantWeight(int(Q.Q4_1), blocks, 64)])
    assert weight_bytes_per_token(model) == floats + blocks.numel()
