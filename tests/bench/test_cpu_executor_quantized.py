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
    md = (tmp_path / "2000-01-01-t-cpu_executor.md").read_text()
    assert "GGUF blocks served as such (Q4_1" in md and "CPU: " in md
