"""Incremental detokenizer with the real SmolLM2 tokenizer: UTF-8 split across tokens, stop strings
across chunk boundaries, ending tokens."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpu_frontend.detokenizer import StopMatcher
from dpu_frontend.tokenizer import ModelTokenizer
from frontend_procs import smollm2

MIXED = "Hi 😀👍🏽 世界, Ünïcödé ✓ 🇫🇷 — naïve café. 日本語のテキスト 🤖🧠!"


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return smollm2()


def run(tok, ids, batches=None, **kw):
    """Feed `ids` in `batches` (sizes); returns (deltas, detokenizer)."""
    d = tok.detokenizer(**kw)
    deltas, i = [], 0
    for n in batches or [1] * len(ids):
        deltas.append(d.feed(ids[i:i + n]).text)
        i += n
        if d.finished:
            break
    deltas.append(d.flush())
    return deltas, d


def test_multibyte_characters_split_across_tokens(tok):
    ids = tok.encode(MIXED, add_special_tokens=False)
    # The emoji and CJK characters really are split across byte-level tokens.
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert len(partial) >= 4
    deltas, d = run(tok, ids)
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == MIXED == d.text
    assert d.tokens_seen == len(ids) and not d.finished


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from(list("ab c\n1é世界😀👍🏽🇫🇷ü—")), min_size=1, max_size=40),
       cuts=st.lists(st.integers(1, 5), min_size=1, max_size=30))
def test_any_batching_reproduces_the_text(text, cuts):
    tok = smollm2()
    ids = tok.encode(text, add_special_tokens=False)
    batches = (cuts * (len(ids) // len(cuts) + 1))
    deltas, d = run(tok, ids, batches)
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_output_cut_mid_character_never_renders_replacement(tok):
    ids = tok.encode("ok 😀", add_special_tokens=False)
    head = ids[:-1]   # max_tokens reached inside the emoji's bytes
    assert "\ufffd" in tok.decode(head)
    deltas, d = run(tok, head)
    assert "".join(deltas) == "ok " and "\ufffd" not in d.text   # the space is whole, the emoji bytes are not


def test_stop_string_spanning_tokens_truncates_and_finishes(tok):
    text = "Hello world, stop here please and more"
    ids = tok.encode(text, add_special_tokens=False)
    deltas, d = run(tok, ids, stop=("stop here",))
    assert "".join(deltas) == "Hello world, "
    assert d.finished and d.stop_reason == "stop here"
    # no delta ever showed a part of the stop string
    assert not any("stop" in x for x in deltas)
    assert d.tokens_seen < len(ids)   # the tokens after the match were not consumed


def test_stop_string_included_when_asked(tok):
    ids = tok.encode("one two three four", add_special_tokens=False)
    deltas, d = run(tok, ids, stop=("three",), include_stop_str_in_output=True)
    assert "".join(deltas) == "one two three" and d.stop_reason == "three"


def test_held_back_prefix_is_released_when_it_does_not_match(tok):
    ids = tok.encode("a stoq b stop", add_special_tokens=False)
    deltas, d = run(tok, ids, stop=("stop",))
    assert "".join(deltas) == "a stoq b "
    ids = tok.encode("ends with sto", add_special_tokens=False)
    deltas, d = run(tok, ids, stop=("stop",))
    assert "".join(deltas) == "ends with sto" and not d.finished   # flush releases the held tail


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    deltas, d = run(tok, ids, batches=[len(ids)], stop=("gamma", "beta", "a b"))
    assert "".join(deltas) == "alph" and d.stop_reason == "a b"


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab c世😀")), min_size=2, max_size=30),
       data=st.data())
def test_stop_string_matches_reference(text, data):
    tok = smollm2()
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start:start + data.draw(st.integers(1, 4))]
    ids = tok.encode(text, add_special_tokens=False)
    cuts = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=10))
    deltas, d = run(tok, ids, cuts * (len(ids) // len(cuts) + 1), stop=(stop,))
    full = tok.decode(ids)
    assert "".join(deltas) == full[:full.find(stop)]
    assert d.finished and d.stop_reason == stop
    _, one_by_one = run(tok, ids, stop=(stop,))
    assert d.tokens_seen == one_by_one.tokens_seen   # usage stops at the token that completed the match
    assert stop in tok.decode(ids[:d.tokens_seen])


@settings(max_examples=80, deadline=None)
@given(ids=st.lists(st.integers(17, 49151), min_size=1, max_size=40),
       cuts=st.lists(st.integers(1, 6), min_size=1, max_size=10))
def test_arbitrary_token_ids_any_batching(ids, cuts):
    """Whatever the model emits (broken byte sequences included), batching does not change the text,
    and only the final incomplete character is dropped."""
    tok = smollm2()
    deltas, _ = run(tok, ids, cuts * (len(ids) // len(cuts) + 1))
    one, _ = run(tok, ids)
    assert "".join(deltas) == "".join(one) == tok.decode(ids).rstrip("\ufffd")
    assert not any(x.endswith("\ufffd") for x in deltas)


def test_eos_ends_the_request_and_is_not_rendered(tok):
    ids = tok.encode("done", add_special_tokens=False) + [2] + tok.encode(" after", add_special_tokens=False)
    deltas, d = run(tok, ids, batches=[len(ids)])
    assert "".join(deltas) == "done" and d.finished and d.stop_reason is None
    assert d.tokens_seen == len(tok.encode("done", add_special_tokens=False)) + 1   # EOS counted


def test_ignore_eos_keeps_going_without_rendering_specials(tok):
    ids = tok.encode("done", add_special_tokens=False) + [2] + tok.encode(" after", add_special_tokens=False)
    deltas, d = run(tok, ids, ignore_eos=True)
    assert "".join(deltas) == "done after" and not d.finished and d.tokens_seen == len(ids)


def test_stop_token_id_reported_as_stop_reason(tok):
    ids = tok.encode("x y z", add_special_tokens=False)
    deltas, d = run(tok, ids, stop_token_ids=(ids[1],))
    assert "".join(deltas) == tok.decode(ids[:1]) and d.stop_reason == ids[1] and d.tokens_seen == 2


def test_special_tokens_rendered_when_not_skipped(tok):
    ids = tok.encode("<|im_start|>user", add_special_tokens=False)
    deltas, _ = run(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) == "<|im_start|>user"


def test_stop_matcher_holds_only_possible_prefixes():
    m = StopMatcher(("abc", "xyz"))
    assert m.feed("12ab") == "12" and m.held == "ab"
    assert m.feed("d") == "abd" and m.held == ""
    assert m.feed("xy") == "" and m.feed("z!") == "" and m.matched == "xyz"
    m = StopMatcher(("aab",))
    assert m.feed("aaa") == "a" and m.held == "aa"
    assert m.feed("b") == "" and m.matched == "aab"   # "aaab": the output is "a"
    assert StopMatcher(()).feed("anything") == "anything"


def test_non_byte_level_decoder_keeps_spaces_between_batches():
    """A Metaspace decoder strips the leading space of a decode: the prefix window keeps it right."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from dpu_frontend.detokenizer import Detokenizer
    vocab = {"<unk>": 0, "▁hello": 1, "▁big": 2, "▁world": 3, "s": 4}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    ids = [1, 2, 3, 4, 1]
    for batches in ([1] * 5, [2, 3], [5]):
        d = Detokenizer(t)
        out, i = [], 0
        for n in batches:
            out.append(d.feed(ids[i:i + n]).text)
            i += n
        assert "".join(out) + d.flush() == t.decode(ids) == "hello big worlds hello"
