"""Workloads: length specs, exact prompt lengths with the real SmolLM2 tokenizer, ShareGPT files."""
import json

import numpy as np
import pytest

from bench.workload import (PRESETS, LengthDist, WorkloadError, build_requests, load_sharegpt, load_tokenizer,
                            parse_length, spec_from_args)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("default")


def test_parse_length_forms_and_errors():
    assert parse_length("128") == LengthDist("const", 128.0)
    assert parse_length("uniform:64:192") == LengthDist("uniform", 64.0, 192.0)
    assert parse_length("lognormal:1019:900") == LengthDist("lognormal", 1019.0, 900.0)
    assert parse_length("lognormal:50:0") == LengthDist("const", 50.0)
    for bad in ("0", "abc", "uniform:5", "uniform:9:3", "gamma:1:2", "normal:0:3"):
        with pytest.raises(WorkloadError):
            parse_length(bad)


def test_length_samples_have_the_requested_mean_and_bounds():
    rng = np.random.default_rng(0)
    x = parse_length("lognormal:1019:900").sample(rng, 20000, 1, 100000)
    assert abs(x.mean() - 1019) < 30
    u = parse_length("uniform:64:192").sample(rng, 5000, 1, 4096)
    assert u.min() >= 64 and u.max() <= 192
    c = parse_length("normal:10:50").sample(rng, 1000, 1, 20)
    assert c.min() >= 1 and c.max() <= 20


def test_synthetic_prompts_have_exact_token_lengths(tok):
    spec = spec_from_args("cpu2", "uniform:5:300", "7", None, seed=3)
    reqs = build_requests(spec, tok, 40)
    rng = np.random.default_rng(3)
    wanted = spec.input_len.sample(rng, 40, 2, spec.max_input_len)
    assert [r.prompt_tokens for r in reqs] == [int(w) for w in wanted]
    for r in reqs:
        assert len(tok.encode(r.prompt)) == r.prompt_tokens
        assert r.output_tokens == 7
        assert r.prompt.strip()  # real text, not empty
    again = build_requests(spec, tok, 40)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]   # deterministic for a seed


def test_presets_include_the_paper_sharegpt_shape(tok):
    spec = spec_from_args("sharegpt", None, None, None, 0)
    assert spec.input_len.mean() == 1019 and spec.output_len.mean() == 463
    assert set(PRESETS) >= {"sharegpt", "sharegpt-small", "cpu2", "smoke"}
    with pytest.raises(WorkloadError):
        spec_from_args("nope", None, None, None, 0)


def test_sharegpt_file_json_and_jsonl(tok, tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "What is the capital of France? Tell me."},
                               {"from": "gpt", "value": "The capital of France is Paris, a large city."}]},
            {"conversations": [{"from": "human", "value": "hi"}]},                 # one turn: skipped
            {"messages": [{"role": "user", "content": "Write two sentences about the sea, please."},
                          {"role": "assistant", "content": "The sea is wide and deep. It is blue."}]}]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(rows))
    assert len(load_sharegpt(str(p))) == 2
    pl = tmp_path / "sg.jsonl"
    pl.write_text("\n".join(json.dumps(r) for r in rows))
    assert len(load_sharegpt(str(pl))) == 2
    spec = spec_from_args("cpu2", None, None, str(p), 0)
    reqs = build_requests(spec, tok, 5)
    assert len(reqs) == 5
    for r in reqs:
        assert r.prompt_tokens == len(tok.encode(r.prompt)) and r.output_tokens >= 4
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(WorkloadError):
        load_sharegpt(str(tmp_path / "bad.json"))
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(WorkloadError):
        load_sharegpt(str(tmp_path / "empty.json"))
    with pytest.raises(WorkloadError):
        spec_from_args("cpu2", None, None, str(tmp_path / "missing.json"), 0)
