"""What the ordering needs to know of one batch request, read from its body without sending it.

    BatchRequest -> work_item(request, tokenizer) -> Work
        key: the prompt as the server will see it: the chat template rendered over the
             messages (chat) or the prompt text (completions), encoded by the model's
             tokenizer; token ids given as the prompt are used as they are. Without a
             tokenizer (none loadable) the key is the text itself, and its length / 4
             stands in for the token count.
        output_tokens: max_completion_tokens or max_tokens, times n; when the body gives
             none, the frontend's defaults as an estimate (completions 16; chat has no
             bound, CHAT_OUTPUT_ESTIMATE stands in).

A body the server will reject still gets a Work (empty key): the server answers it.
"""
from __future__ import annotations

from typing import Any

from ..tokenizer import ChatTemplateError, ModelTokenizer
from .batch_file import BatchRequest
from .ordering import Work

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # the frontend's default for /v1/completions
CHAT_OUTPUT_ESTIMATE = 256            # chat without max_tokens may run to the context's end
CHARS_PER_TOKEN = 4


def output_tokens(request: BatchRequest) -> int:
    body = request.body
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            break
    else:
        v = COMPLETIONS_DEFAULT_MAX_TOKENS if request.url == "/v1/completions" else CHAT_OUTPUT_ESTIMATE
    n = body.get("n")
    return v * (n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1)


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):   # content parts: their text in order
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prompt_text(request: BatchRequest, tokenizer: ModelTokenizer | None) -> str | list[int]:
    """The prompt: text, or token ids when the body gives ids."""
    body = request.body
    if request.url == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:   # a list of prompts: the first one stands for them
            prompt = prompt[0] if not all(isinstance(t, int) for t in prompt) else prompt
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        return ""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ""
    plain = [{"role": str(m.get("role", "")), "content": _text_of(m.get("content"))}
             for m in messages if isinstance(m, dict)]
    if tokenizer is not None:
        try:
            return tokenizer.render_chat(plain)
        except ChatTemplateError:
            pass
    return "".join(f"{m['role']}\n{m['content']}\n" for m in plain)


def work_item(request: BatchRequest, tokenizer: ModelTokenizer | None) -> Work:
    prompt = prompt_text(request, tokenizer)
    if isinstance(prompt, list):
        return Work(tuple(prompt), len(prompt), output_tokens(request))
    if tokenizer is not None:
        ids = tuple(tokenizer.encode(prompt, add_special_tokens=False))
        return Work(ids, len(ids), output_tokens(request))
    return Work(prompt, max(1, len(prompt) // CHARS_PER_TOKEN) if prompt else 0, output_tokens(request))
