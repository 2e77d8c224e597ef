"""ModelConfig: the hyperparameters of a Llama-family decoder, in one frozen dataclass.

HF config.json (dict) -> ModelConfig.from_hf -> LlamaModel / KV-cache sizing;
ModelConfig.to_hf -> config.json when the loader writes an HF folder (the default
model converted from GGUF). Covers Llama 2/3, SmolLM2, Qwen2 (q/k/v bias) and
Qwen3 (per-head q/k RMSNorm) shapes.
"""
from __future__ import annotations

import dataclasses
from typing import Any

# model_type -> (attention_bias default, qk_norm); Qwen2 always has q/k/v bias,
# Qwen3 always has q/k norm; the others follow config.json.
_ARCHS = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}
_HF_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# RoPE scaling kinds LlamaModel implements; anything else is refused at load.
ROPE_SCALING_TYPES = ("default", "llama3", "linear")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str                       # HF model_type: llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int          # SwiGLU inner width
    num_layers: int
    num_heads: int                  # query heads
    num_kv_heads: int               # key/value heads (GQA when < num_heads)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool       # lm_head shares embed_tokens.weight
    attention_bias: bool            # bias on q/k/v projections (Qwen2)
    qk_norm: bool                   # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Extension beyond the agreed contract (defaulted): Llama 3.1-style RoPE scaling.
    rope_scaling: tuple[tuple[str, Any], ...] = ()   # sorted items of HF rope_scaling

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("rope_theta and rms_norm_eps must be positive")
        kind = self.rope_scaling_dict.get("rope_type", "default")
        if kind not in ROPE_SCALING_TYPES:
            raise ValueError(f"unsupported rope_scaling type {kind!r} "
                             f"(supported: {', '.join(ROPE_SCALING_TYPES)})")

    @property
    def o_proj_bias(self) -> bool:
        """HF Llama/Qwen3 attention_bias also biases o_proj; Qwen2 biases only q/k/v."""
        return self.attention_bias and self.arch != "qwen2"

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes for one token across all layers at float32 (scale for other dtypes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed HF config.json; raises ValueError on unsupported models."""
        if not isinstance(hf, dict):
            raise ValueError("config.json must hold a JSON object")
        arch = str(hf.get("model_type", "llama"))
        if arch not in _ARCHS:
            raise ValueError(f"unsupported model_type {arch!r} (supported: {', '.join(_ARCHS)})")
        bias_default, qk_norm = _ARCHS[arch]
        try:
            hidden = int(hf["hidden_size"])
            num_heads = int(hf["num_attention_heads"])
            eos = hf.get("eos_token_id")
            eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
            attention_bias = bool(hf.get("attention_bias", bias_default)) if arch != "qwen2" else True
            scaling = hf.get("rope_scaling") or {}
            if "type" in scaling and "rope_type" not in scaling:
                scaling = {**scaling, "rope_type": scaling["type"]}
            scaling = {k: v for k, v in scaling.items() if k != "type"}
            if scaling.get("rope_type") == "default":
                scaling = {}
            return cls(
                arch=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(hf.get("rope_theta", 10000.0)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=attention_bias,
                qk_norm=qk_norm,
                bos_token_id=None if hf.get("bos_token_id") is None else int(hf["bos_token_id"]),
                eos_token_ids=eos_ids,
                rope_scaling=tuple(sorted(scaling.items())),
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks required key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"invalid config.json: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """The HF config.json dict that from_hf reads back to an equal ModelConfig."""
        eos: int | list[int] | None
        eos = (self.eos_token_ids[0] if len(self.eos_token_ids) == 1
               else list(self.eos_token_ids) or None)
        hf: dict[str, Any] = {
            "architectures": [_HF_ARCH_CLASS[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict or None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": "float32",
        }
        if self.arch == "qwen2":
            hf["attention_bias"] = True
        return hf


def tiny_config(**overrides: Any) -> ModelConfig:
    """A small Llama config for fast tests (2 layers, hidden 64, 4 heads / 2 KV heads, vocab 512)."""
    base: dict[str, Any] = dict(
        arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False,
        qk_norm=False, bos_token_id=1, eos_token_ids=(2,),
    )
    base.update(overrides)
    return ModelConfig(**base)
