"""load_model(quantized=True): a GGUF's Q4_0/Q4_1/Q8_0/Q4_K matrices stay in their blocks as
QuantLinear modules (Q/K rows un-permuted as rows of blocks) holding exactly the values the
float loader dequantizes; other types load as float with one log line; HF folders ignore it."""
from __future__ import annotations

import logging

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_backend.model.config import tiny_config
from gpu_backend.model.gguf_weights import write_gguf
from gpu_backend.model.llama import LlamaModel
from gpu_backend.model.loader import hf_state_dict, load_model, save_hf_folder
from gpu_backend.model.quantized import QuantLinear, dequantize_all, fuse_quantized

# hidden 64, FFN 128: K in whole 32-value blocks everywhere
CONFIG = dict(hidden_size=64, intermediate_size=128)


def write(tmp_path, config, types):
    source = LlamaModel.random(config, seed=4)
    tensors = hf_state_dict(source)
    path = tmp_path / "q.gguf"
    write_gguf(path, config, tensors, types={n: t for n, t in ((n, types(n)) for n in tensors) if t is not None})
    return path


@pytest.mark.parametrize("variant", [dict(), dict(tie_word_embeddings=True), dict(arch="qwen2", attention_bias=True)],
                         ids=["llama-untied", "llama-tied", "qwen2-bias"])
def test_quantized_matrices_hold_what_the_float_loader_dequantizes(tmp_path, variant):
    config = tiny_config(**CONFIG, **variant)
    kinds = {"q_proj": Q.Q4_1, "k_proj": Q.Q4_0, "v_proj": Q.Q8_0, "o_proj": Q.Q4_1, "gate_proj": Q.Q4_0,
             "up_proj": Q.Q4_1, "down_proj": Q.Q8_0, "lm_head": Q.Q8_0, "embed_tokens": Q.Q8_0}
    path = write(tmp_path, config, lambda n: next((t for part, t in kinds.items() if f".{part}." in f".{n}"), None))
    floats = load_model(path).model
    quant = load_model(path, quantized=True).model
    for i, layer in enumerate(quant.layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            mod = getattr(layer.self_attn, name)
            assert isinstance(mod, QuantLinear) and mod.segments[0].type_name == kinds[name].name
            ref = getattr(floats.layers[i].self_attn, name)
            assert torch.equal(mod.dequantize(), ref.weight)
            if ref.bias is not None:
                assert torch.equal(mod.bias, ref.bias)
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(getattr(layer.mlp, name).dequantize(), getattr(floats.layers[i].mlp, name).weight)
    assert torch.equal(quant.embed_tokens.weight, floats.embed_tokens.weight)     # the lookup stays float
    assert isinstance(quant.logits_head, QuantLinear)                            # the logits read the blocks
    assert torch.equal(quant.logits_head.dequantize(), floats.lm_head_weight)
    # Fused as rows of blocks, dequantized back: the float model's fused projections.
    fuse_quantized(quant)
    floats.fuse_projections()
    assert len(quant.layers[0].self_attn.qkv_proj.segments) == 3              # Q4_1 | Q4_0 | Q8_0
    assert torch.equal(quant.layers[0].self_attn.qkv_proj.dequantize(), floats.layers[0].self_attn.qkv_proj.weight)
    dequantize_all(quant)
    assert not any(isinstance(m, QuantLinear) for m in quant.modules())
    ids = torch.tensor([3, 1, 4, 1, 5])
    from gpu_backend.model.attention import DenseCausalAttention
    with torch.inference_mode():
        want = floats.compute_logits(floats(ids, torch.arange(5), DenseCausalAttention(config)))
        got = quant.compute_logits(quant(ids, torch.arange(5), DenseCausalAttention(config)))
    assert torch.equal(got, want)


def test_other_types_load_as_float_with_a_log_line(tmp_path, caplog):
    config = tiny_config(**CONFIG)
    path = write(tmp_path, config, lambda n: Q.Q5_0 if n.endswith("down_proj.weight") else
                 (Q.Q4_1 if n.endswith("up_proj.weight") else None))
    with caplog.at_level(logging.INFO, logger="blink.gpu_daemon"):
        model = load_model(path, quantized=True).model
    assert "Q5_0" in caplog.text and "dequantized" in caplog.text
    assert type(model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert isinstance(model.layers[0].mlp.up_proj, QuantLinear)


def test_hf_folders_have_no_blocks_and_load_as_they_are(tmp_path):
    model = LlamaModel.random(tiny_config(**CONFIG), seed=1)
    folder = save_hf_folder(model, tmp_path / "hf")
    loaded = load_model(folder, quantized=True).model
    assert not any(isinstance(m, QuantLinear) for m in loaded.modules())
