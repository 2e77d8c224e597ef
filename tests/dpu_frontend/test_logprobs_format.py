"""logprobs_format: the daemon's records -> the completions and chat logprobs objects."""
import math

import numpy as np

from dpu_frontend import logprobs_format as lpf

VOCAB = {0: "<s>", 1: " a", 2: " b", 3: "c", 4: "é"}


def decode(ids, skip_special_tokens=True):
    return "".join(VOCAB[i] for i in ids)


def rec(lp, rank, ids, tops):
    k = len(ids)
    w = np.zeros(2 + 2 * k, "<i4")
    w[0] = np.float32(lp).view("<i4")
    w[1] = rank
    w[2:2 + k] = ids
    w[2 + k:] = np.array(tops, "<f4").view("<i4")
    return w


def test_completion_piece_offsets_top_dict_and_floor():
    text = lpf.TokenText(decode)
    c = lpf.CompletionLogprobs(text)
    records = np.stack([rec(-0.1, 1, [1, 2], [-0.1, -2.0]), rec(-3.0, 3, [1, 2], [-0.5, -1.0]),
                        rec(-math.inf, 5, [1, 2], [-0.5, -1.0])])
    p = c.piece([1, 3, 4], records)
    assert p["tokens"] == [" a", "c", "é"] and p["text_offset"] == [0, 2, 3]
    assert p["token_logprobs"][:2] == [np.float32(-0.1).item(), -3.0] and p["token_logprobs"][2] == -9999.0
    assert p["top_logprobs"][0] == {" a": np.float32(-0.1).item(), " b": -2.0}     # scored token first, deduped
    assert list(p["top_logprobs"][1]) == ["c", " a", " b"]                          # k + 1 when not in the top
    nxt = c.piece([2], records[:1])
    assert nxt["text_offset"] == [4]                                                # offsets continue


def test_echoed_prompt_starts_null_and_blank_records_are_null():
    text = lpf.TokenText(decode)
    p = lpf.CompletionLogprobs(text).piece([0, 1, 2], np.stack([rec(-1.0, 2, [], []), rec(float("nan"), 0, [], [])]),
                                           first_is_null=True)
    assert p["token_logprobs"] == [None, -1.0, None] and p["top_logprobs"] == [None, {" a": -1.0}, None]


def test_chat_content_and_prompt_logprobs():
    text = lpf.TokenText(decode)
    records = np.stack([rec(-0.25, 1, [4, 2, 1], [-0.25, -2.0, -3.0])])
    (entry,) = lpf.chat_content(text, [4], records, top_n=2)
    assert entry == {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9],
                     "top_logprobs": [{"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9]},
                                      {"token": " b", "logprob": -2.0, "bytes": [32, 98]}]}
    pl = lpf.prompt_logprobs(text, [0, 3], np.stack([rec(-4.0, 7, [1], [-0.5])]))
    assert pl == [None, {"3": {"logprob": -4.0, "rank": 7, "decoded_token": "c"},
                         "1": {"logprob": -0.5, "rank": 1, "decoded_token": " a"}}]
