"""GGUF file -> (ModelConfig, HF-named float32 state dict).

gguf.GGUFReader (memory-mapped) -> hyperparameters from `{arch}.*` metadata ->
each tensor dequantized with gguf.quants.dequantize -> renamed from llama.cpp's
names (token_embd, blk.N.attn_q, ...) to HF's (model.embed_tokens,
model.layers.N.self_attn.q_proj, ...) -> Q/K rows un-permuted for the llama
arch (llama.cpp's converter interleaves the RoPE halves; LlamaModel uses HF's
rotate_half order). Everything stays on the CPU; the loader casts and moves.

With quantized=True, projection and output matrices in a type the CPU kernels read
(model/quantized.py: Q4_0, Q4_1, Q8_0, Q4_K) stay in their blocks as QuantWeight
(rows un-permuted as rows of blocks); a tied token_embd is returned both ways:
float32 as the embedding, blocks as "lm_head.weight" (the logits matmul).
"""
from __future__ import annotations

import logging
import os
import re

import gguf
import numpy as np
import torch
from gguf import quants

from .config import ModelConfig
from .quantized import QuantWeight, is_served

log = logging.getLogger("blink.gpu_daemon")

# general.architecture -> HF model_type
_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


class GGUFModelError(ValueError):
    """The GGUF file is unreadable or holds a model this loader does not support."""


class _WeightsReader(gguf.GGUFReader):
    """gguf.GGUFReader that reads metadata arrays in one piece instead of element by element.

    The stock reader makes a few numpy memmap views per array element: 8.3 of the 13.7 s the
    CPU executor took to load the embedded Q4_1 SmolLM2 on the idle 2-core EPYC (~40 s under
    load) went to the tokenizer's ~49k tokens, ~49k merges and ~49k token types, metadata the
    daemon never reads (the tokenizer lives with the frontend). Here an array of numbers is one
    view (contents() returns the same list), and an array of strings is skipped in one pass over
    its lengths: it keeps its element count (array_length) and reads back as an empty list."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        itype, count, offs = gguf.GGUFValueType(raw_itype[0]), int(alen[0]), orig_offs + 12
        if itype in self.gguf_scalar_to_np:
            values = self._get(offs, self.gguf_scalar_to_np[itype], count)
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2], [gguf.GGUFValueType.ARRAY, itype]
        if itype != gguf.GGUFValueType.STRING:          # arrays of arrays: the stock reader's way
            return super()._get_field_parts(orig_offs, raw_type)
        buf = self.data.view(np.ndarray)                # a plain buffer: no memmap view per string
        for _ in range(count):
            offs += 8 + int.from_bytes(buf[offs:offs + 8].tobytes(), "little")
        if offs > len(buf):
            raise ValueError("a string array runs past the end of the file")
        return offs - orig_offs, [raw_itype, alen, self.data[orig_offs + 12:offs]], [], \
            [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]


def array_length(reader: gguf.GGUFReader, key: str) -> int | None:
    """Elements of the array field `key` (also of one _WeightsReader skipped); None if absent."""
    field = reader.fields.get(key)
    if field is None or field.types[:1] != [gguf.GGUFValueType.ARRAY]:
        return None
    return int(field.parts[4][0])          # key length, key, value type, element type, count


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """The file's metadata (arrays of strings skipped: _WeightsReader) and its tensors, memory-mapped."""
    if not os.path.isfile(path):
        raise GGUFModelError(f"GGUF file not found: {path}")
    try:
        return _WeightsReader(path)
    except Exception as e:  # the gguf package raises ValueError/struct.error/... on junk
        raise GGUFModelError(f"{path}: not a readable GGUF file ({e})") from None


def _get(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value: float) -> float:
    """The shortest decimal that round-trips a GGUF float32 (1e-5, not 9.99999974e-06)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def config_from_gguf(reader: gguf.GGUFReader) -> ModelConfig:
    """Hyperparameters from the `{arch}.*` and tokenizer metadata of a GGUF file."""
    arch = _get(reader, "general.architecture")
    if arch not in _ARCHS:
        raise GGUFModelError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(_ARCHS)})")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise GGUFModelError("GGUF with rope_freqs (Llama 3.1-style RoPE scaling factors) is not supported")

    def need(key: str):
        value = _get(reader, f"{arch}.{key}")
        if value is None:
            raise GGUFModelError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, num_heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(_get(reader, f"{arch}.attention.key_length")
                   or _get(reader, f"{arch}.rope.dimension_count") or hidden // num_heads)
    vocab = int(_get(reader, f"{arch}.vocab_size") or array_length(reader, "tokenizer.ggml.tokens") or 0)
    if not vocab:
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        vocab = int(embd.shape[-1]) if embd is not None else 0
    eos = _get(reader, "tokenizer.ggml.eos_token_id")
    eot = _get(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(e) for e in (eos, eot) if e is not None))
    bos = _get(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        arch=_ARCHS[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_get(reader, f"{arch}.attention.head_count_kv") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=_f32(_get(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(_get(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_get(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
        qk_norm=arch == "qwen3",
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
    )


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute on a q/k weight [n_head*D, in] or bias [n_head*D].

    llama.cpp stores each head's rows as interleaved (re, im) pairs; HF keeps the
    two rotary halves contiguous. permute = reshape(n_head, 2, D/2, ...).swapaxes(1, 2).
    """
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's permutation (HF order -> GGUF order); for writing test GGUFs."""
    rest = w.shape[1:]
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    """HF tensor name for a llama.cpp one, None when it has no HF counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _quantized(tensor, name: str, config: ModelConfig) -> QuantWeight | None:
    """The tensor as blocks, where it is a matrix the kernels read in this type, else None."""
    matrix = name.endswith("_proj.weight") or name in ("lm_head.weight", "model.embed_tokens.weight")
    n, k = (int(d) for d in reversed(tensor.shape)) if len(tensor.shape) == 2 else (0, 0)
    if not matrix or not k or not is_served(int(tensor.tensor_type), k):
        return None
    blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(n, -1))
    w = QuantWeight(int(tensor.tensor_type), blocks, k)
    heads = config.num_heads if ".q_proj." in name else config.num_kv_heads if ".k_proj." in name else 0
    if config.arch == "llama" and heads:
        w = w.rows(unpermute_rope_rows(torch.arange(n), heads))
    return w


def state_dict_from_gguf(reader: gguf.GGUFReader, config: ModelConfig,
                         quantized: bool = False) -> dict[str, torch.Tensor | QuantWeight]:
    """Dequantized float32 tensors under HF names (tied models get no lm_head.weight); with
    `quantized`, the matrices the CPU kernels read as QuantWeight (module docstring)."""
    out: dict[str, torch.Tensor | QuantWeight] = {}
    unserved: set[str] = set()
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            raise GGUFModelError(f"unexpected tensor {tensor.name!r} in GGUF file")
        q = _quantized(tensor, name, config) if quantized else None
        if quantized and q is None and name.endswith("_proj.weight") and tensor.tensor_type.name not in (
                "F32", "F16", "BF16"):
            unserved.add(tensor.tensor_type.name)
        if q is not None and name == "model.embed_tokens.weight":
            if config.tie_word_embeddings:
                out["lm_head.weight"] = q          # the logits matmul reads the blocks; the lookup, floats
        elif q is not None:
            out[name] = q
            continue
        try:
            array = quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise GGUFModelError(f"tensor {tensor.name}: quantization {tensor.tensor_type.name} "
                                 "cannot be dequantized by the gguf package") from None
        # ggml lists dims fastest-first; numpy/torch want them slowest-first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        # np.array copies: F32 tensors are read-only views of the memory-mapped file.
        w = torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))
        if config.arch == "llama" and ".q_proj." in name:
            w = unpermute_rope_rows(w, config.num_heads)
        elif config.arch == "llama" and ".k_proj." in name:
            w = unpermute_rope_rows(w, config.num_kv_heads)
        out[name] = w
    if unserved:
        log.info("GGUF matrices in %s are dequantized to float (the CPU kernels read Q4_0, Q4_1, Q8_0, Q4_K)",
                 ", ".join(sorted(unserved)))
    return out


def gguf_name(hf: str) -> str:
    """llama.cpp tensor name for an HF one (inverse of hf_name)."""
    for g, h in _GLOBAL_NAMES.items():
        if h == hf:
            return g
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf)
    for g, h in _LAYER_NAMES.items():
        if m and m.group(2) == h:
            return f"blk.{m.group(1)}.{g}"
    raise KeyError(f"no GGUF name for tensor {hf!r}")


def write_gguf(path: str | os.PathLike, config: ModelConfig, tensors: dict[str, torch.Tensor],
               tokens: list[str] | None = None, token_types: list[int] | None = None,
               merges: list[str] | None = None, pre: str = "smollm",
               types: dict[str, gguf.GGMLQuantizationType] | None = None) -> None:
    """Write HF-named tensors as a GGUF the way llama.cpp's converter lays it out.

    llama arch Q/K rows permuted, `{arch}.*` hyperparameters, optional gpt2-style
    vocabulary. F32, except the tensors `types` names, quantized by gguf's own
    quantizer (Q4_0, Q4_1, Q8_0, ...). For tests and small exports.
    """
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[config.arch]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if config.bos_token_id is not None:
        writer.add_bos_token_id(config.bos_token_id)
    if config.eos_token_ids:
        writer.add_eos_token_id(config.eos_token_ids[0])
    if tokens is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(token_types or [1] * len(tokens))
        writer.add_token_merges(merges or [])
        writer.add_add_bos_token(False)
    for name, w in tensors.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = w.detach().float().cpu()
        if arch == "llama" and ".q_proj." in name:
            w = permute_rope_rows(w, config.num_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = permute_rope_rows(w, config.num_kv_heads)
        qtype = (types or {}).get(name)
        if qtype is None:
            writer.add_tensor(gguf_name(name), w.numpy().copy())
        else:
            writer.add_tensor(gguf_name(name), quants.quantize(w.numpy(), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
