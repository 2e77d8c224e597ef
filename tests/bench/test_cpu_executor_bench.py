"""bench.cpu_executor end to end on a tiny random model folder: the executor with its fused
kernels, the same executor without them, and the unbatched loop, in one run; the JSON and
markdown it writes."""
from __future__ import annotations

import json

import torch

from bench import cpu_executor
from gpu_backend import cpu_kernels
from gpu_backend.model import LlamaModel, tiny_config
from gpu_backend.model.loader import save_hf_folder


def test_cpu_executor_bench_compares_the_kernel_layer_in_the_same_run(tmp_path):
    folder = save_hf_folder(LlamaModel.random(tiny_config(head_dim=32), seed=2), tmp_path / "model")
    threads = torch.get_num_threads()
    try:
        assert cpu_executor.main(["--model", str(folder), "--threads", "1", "--batches", "1,2", "--prompts", "8,16",
                                  "--decode-tokens", "4", "--reps", "1", "--date", "2000-01-01", "--machine", "t",
                                  "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    r = json.loads((tmp_path / "2000-01-01-t-cpu_executor.json").read_text())
    assert r["executor"]["fused_kernels"] == (cpu_kernels.load() is not None)
    for b in ("1", "2"):
        assert r["executor"]["decode_tok_s"][b] > 0 and r["executor_pytorch_layer"]["decode_tok_s"][b] > 0
        assert r["ratios"]["decode_vs_pytorch_layer"][b] > 0
    assert "kernels / PyTorch layer" in (tmp_path / "2000-01-01-t-cpu_executor.md").read_text()
