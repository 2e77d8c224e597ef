"""The OpenAI sampling surface end to end: `blink serve --dtype float32` on SmolLM2 (CPU
executor), the official `openai` client, and logprobs checked against an independent
float32 forward of the same weights written here in plain torch."""
from __future__ import annotations

import json
import math
import os

import openai
import pytest
import torch

from frontend_procs import Serve, smollm2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
TOL = 2e-3


@pytest.fixture(scope="module")
def server():
    ring = f"blink-test-sampling-{os.getpid()}"
    with Serve(ring, "--dtype", "float32", "--max-batch-size", "8", ready_timeout_s=540) as s:
        yield s
        assert s.stop() == 0, s.output


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


class Reference:
    """SmolLM2 (Llama) in float32 from its safetensors, no serving code: logprobs [T, vocab]."""

    def __init__(self):
        from safetensors.torch import load_file

        from gpu_backend.model.default_model import default_model_dir
        folder = default_model_dir()
        self.cfg = json.loads((folder / "config.json").read_text())
        self.w = {k.removeprefix("model."): v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}

    @torch.inference_mode()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        c, w = self.cfg, self.w
        heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        eps = c["rms_norm_eps"]
        T = len(ids)

        def norm(x, g):
            return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

        inv = 1.0 / c["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]                # [T, d/2]
        cos, sin = torch.cat([ang, ang], -1).cos().float(), torch.cat([ang, ang], -1).sin().float()

        def rope(x):                                                                     # [h, T, d]
            x1, x2 = x[..., :d // 2], x[..., d // 2:]
            return x * cos + torch.cat([-x2, x1], -1) * sin

        x = w["embed_tokens.weight"][torch.tensor(ids)]                                  # [T, hidden]
        mask = torch.full((T, T), float("-inf")).triu(1)
        for i in range(c["num_hidden_layers"]):
            p = f"layers.{i}."
            h = norm(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(T, heads, d).transpose(0, 1)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(T, kv, d).transpose(0, 1)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, kv, d).transpose(0, 1)
            q, k = rope(q), rope(k)
            k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
            att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d) + mask, -1) @ v     # [h, T, d]
            x = x + att.transpose(0, 1).reshape(T, heads * d) @ w[p + "self_attn.o_proj.weight"].T
            h = norm(x, w[p + "post_attention_layernorm.weight"])
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        logits = norm(x, w["norm.weight"]) @ w["embed_tokens.weight"].T
        return torch.log_softmax(logits, -1)

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        out = []
        for _ in range(n):
            out.append(int(self.logprobs(ids + out)[-1].argmax()))
        return out, self.logprobs(ids + out)


@pytest.fixture(scope="module")
def ref():
    return Reference()


def text(t: int) -> str:
    return smollm2().decode([t], skip_special_tokens=False)


PROMPT = "The capital of France is Paris, and the capital of Germany is"


def test_completion_logprobs_equal_an_independent_float32_forward(client, ref):
    ids = smollm2().encode(PROMPT)
    want_ids, lp = ref.greedy(ids, 5)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    c = r.choices[0]
    got = c.logprobs
    assert got.tokens == [text(t) for t in want_ids]
    assert len(got.token_logprobs) == len(got.top_logprobs) == len(got.text_offset) == 5
    for i, t in enumerate(want_ids):
        row = lp[len(ids) - 1 + i]
        assert abs(got.token_logprobs[i] - row[t].item()) < TOL
        top = row.topk(3)
        want_top = {text(j): v for j, v in zip(top.indices.tolist(), top.values.tolist())}
        assert set(got.top_logprobs[i]) == set(want_top) | {text(t)}
        for s, v in want_top.items():
            assert abs(got.top_logprobs[i][s] - v) < TOL
    assert got.text_offset == [sum(len(s) for s in got.tokens[:i]) for i in range(5)]
    assert c.text == "".join(got.tokens)


def test_echo_with_logprobs_as_lm_eval_sends_it(client, ref):
    ids = smollm2().encode(PROMPT)
    lp = ref.logprobs(ids)
    for max_tokens in (1, 0):
        r = client.completions.create(model=MODEL, prompt=[ids], max_tokens=max_tokens, temperature=0, logprobs=1,
                                      echo=True, seed=1234)
        c = r.choices[0]
        got = c.logprobs
        n = len(ids) + max_tokens
        assert len(got.tokens) == len(got.token_logprobs) == n
        assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
        for j in range(1, len(ids)):
            assert abs(got.token_logprobs[j] - lp[j - 1, ids[j]].item()) < TOL, j
        assert c.text.startswith(smollm2().decode(ids))
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == max_tokens
        if max_tokens:
            assert abs(got.token_logprobs[-1] - lp[-1].max().item()) < TOL   # greedy: the top token's


def test_chat_logprobs_and_top_logprobs(client, ref):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tok = smollm2()
    ids = tok.encode(tok.render_chat(messages), add_special_tokens=False)
    want_ids, lp = ref.greedy(ids, 4)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [text(t) for t in want_ids]
    for i, (e, t) in enumerate(zip(content, want_ids)):
        row = lp[len(ids) - 1 + i]
        assert abs(e.logprob - row[t].item()) < TOL
        assert e.bytes == list(e.token.encode())
        assert [x.token for x in e.top_logprobs] == [text(j) for j in row.topk(2).indices.tolist()]
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6     # greedy: the top one
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                           logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


def test_streamed_logprobs_equal_the_whole_reply(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    whole = client.completions.create(**kw).choices[0].logprobs
    tokens, lps, offsets = [], [], []
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            lps += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert lps == pytest.approx(whole.token_logprobs, abs=1e-6)
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0, logprobs=True, top_logprobs=1,
                                               stream=True))
    entries = [e for c in chat if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert 1 <= len(entries) <= 4 and all(len(e.top_logprobs) == 1 for e in entries)


def test_processors_through_the_client(client):
    tok = smollm2()
    target = tok.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                  logit_bias={str(target): 100})
    assert r.choices[0].text == " banana" * 3
    france = "The capital of France is"
    base = client.completions.create(model=MODEL, prompt=france, max_tokens=4, temperature=0).choices[0].text
    assert "Paris" in base     # "Paris" and " Paris" are one token each: vLLM's rule bans both
    banned = client.completions.create(model=MODEL, prompt=france, max_tokens=4, temperature=0,
                                       extra_body={"bad_words": ["Paris"]}).choices[0].text
    assert "Paris" not in banned
    allowed = tok.encode(" yes no", add_special_tokens=False)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                  extra_body={"allowed_token_ids": allowed})
    assert set(r.choices[0].text.split()) <= {"yes", "no"}
    stop = tok.encode(" Paris", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt=france, max_tokens=6, temperature=0,
                                  extra_body={"stop_token_ids": [stop]})
    assert r.usage.completion_tokens == 1         # " Paris" ends it at once...
    r = client.completions.create(model=MODEL, prompt=france, max_tokens=6, temperature=0,
                                  extra_body={"stop_token_ids": [stop], "min_tokens": 3})
    assert r.usage.completion_tokens >= 3         # ... but not before min_tokens
    ones = dict(model=MODEL, prompt="1 1 1 1 1 1 1", max_tokens=8, temperature=0)
    plain = client.completions.create(**ones, extra_body={"ignore_eos": True}).choices[0].text
    assert plain.count(" 1") >= 4
    r = client.completions.create(**ones, presence_penalty=2.0, frequency_penalty=2.0,
                                  extra_body={"ignore_eos": True, "repetition_penalty": 1.5, "min_p": 0.05,
                                              "top_k": 20})
    assert r.usage.completion_tokens == 8 and r.choices[0].text.count(" 1") <= 1


@pytest.mark.parametrize("kw, param", [
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(n=0), "n"),
    (dict(logit_bias={"not-a-token": 1}), "logit_bias"),
    (dict(logit_bias={"5": 150}), "logit_bias"),
    (dict(max_tokens=3, extra_body={"min_tokens": 5}), "min_tokens"),
])
def test_bad_values_are_400_naming_the_parameter_and_disturb_nobody(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_n_choices_share_a_prefill_and_seeds_reproduce_them(client, server):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=11)
    r = client.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1                                   # seeds 11, 12, 13: different draws
    assert [c.text for c in client.completions.create(n=3, **kw).choices] == texts   # reproducible
    assert client.completions.create(**dict(kw, seed=12)).choices[0].text == texts[1]  # choice i: seed + i
    counted = client.completions.create(n=3, logprobs=0, **kw)           # usage counts every choice's tokens
    assert [c.text for c in counted.choices] == texts
    assert counted.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in counted.choices)
    greedy = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                            max_tokens=5, temperature=0, logprobs=True)
    a, b = greedy.choices
    assert a.message.content == b.message.content and [e.logprob for e in a.logprobs.content] == \
        pytest.approx([e.logprob for e in b.logprobs.content], abs=1e-5)
    assert greedy.usage.completion_tokens == 2 * len(a.logprobs.content)


def test_streamed_choices_carry_their_index_and_best_of_keeps_the_likeliest(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=5)
    whole = client.completions.create(n=2, **kw)
    got = {0: "", 1: ""}
    finishes = {}
    for chunk in client.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            got[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        if chunk.usage:
            assert chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert got == {c.index: c.text for c in whole.choices} and set(finishes) == {0, 1}
    four = client.completions.create(n=4, logprobs=0, **kw).choices
    best = client.completions.create(n=1, best_of=4, **kw)
    scores = {c.text: sum(c.logprobs.token_logprobs) for c in four}
    assert best.choices[0].text == max(scores, key=scores.get) and best.choices[0].logprobs is None
    assert best.usage.completion_tokens >= len(best.choices) and len(best.choices) == 1


def test_streamed_echo_opens_with_the_prompt_and_its_logprobs(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True)
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text and whole.text.startswith(PROMPT)
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    lps = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert tokens == whole.logprobs.tokens and lps[0] is None
    assert lps[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-6)


def test_streamed_prompt_logprobs_arrive_on_the_first_chunk(client):
    """prompt_logprobs on a stream (upstream vLLM refuses them there): the first chunk carries what
    the non-streamed reply carries, in the same place, and no later chunk repeats them."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 1})
    whole = client.completions.create(**kw).choices[0].model_extra["prompt_logprobs"]
    chunks = list(client.completions.create(stream=True, **kw))
    first = chunks[0].choices[0].model_extra["prompt_logprobs"]
    assert first[0] is None and len(first) == len(whole) > 5 and first == whole
    assert all(c.choices[0].model_extra.get("prompt_logprobs") is None for c in chunks[1:] if c.choices)
    messages = [{"role": "user", "content": "Name a city."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 0})
    whole = client.chat.completions.create(**kw).model_extra["prompt_logprobs"]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].model_extra["prompt_logprobs"] == whole and chunks[0].choices[0].delta.role == "assistant"
    assert all(c.model_extra.get("prompt_logprobs") is None for c in chunks[1:])
