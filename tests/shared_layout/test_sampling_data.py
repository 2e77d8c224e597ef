"""The sampling surface in the ring: slot fields, the sampling data in the prompt arena,
logprob records in the logprob arena, and the backend's checks of all three."""
import numpy as np
import pytest

from shared_layout import BackendPort, ErrorCode, FrontendPort, Ring, RingGeometry, SlotRequest, SlotState
from shared_layout.extra import SamplingExtra, decode_extra, encode_extra
from shared_layout.layout import LOGPROBS_OFF, SLOT_DTYPE, logprob_record_words
from shared_layout.ring import request_error

GEOM = RingGeometry(4, 256, 256, 512)


def _ring():
    return Ring.create(bytearray(GEOM.total_size), GEOM)


def test_logprob_arena_follows_the_output_arena():
    assert GEOM.logprob_arena_offset >= GEOM.output_arena_offset + 4 * GEOM.output_arena_tokens
    assert GEOM.total_size >= GEOM.logprob_arena_offset + 4 * 512
    assert RingGeometry(4, 256, 300).logprob_arena_words == 300   # default: the output arena's size


def test_extra_round_trip():
    extra = SamplingExtra(logit_bias=((5, -100.0), (7, 2.5)), allowed_token_ids=(1, 2, 3),
                          bad_words=((9,), (10, 11, 12)))
    words = encode_extra(extra)
    assert words.size == 2 * 2 + 3 + (1 + 1) + (1 + 3)
    assert decode_extra(words, *extra.counts, vocab_size=100) == extra
    with pytest.raises(ValueError, match="vocabulary"):
        decode_extra(words, *extra.counts, vocab_size=10)
    bad = words.copy()
    bad[2:4] = np.array([np.nan, 1.0], "<f4").view("<i4")
    with pytest.raises(ValueError, match="logit_bias values"):
        decode_extra(bad, *extra.counts, vocab_size=100)
    bad = words.copy()
    bad[7] = 40   # a bad word longer than the data left
    with pytest.raises(ValueError, match="malformed"):
        decode_extra(bad, *extra.counts, vocab_size=100)


def test_submit_carries_fields_and_extra_then_backend_reads_them():
    ring = _ring()
    extra = SamplingExtra(logit_bias=((3, 1.5),), allowed_token_ids=(3, 4))
    req = SlotRequest(seq=1, prompt_offset=0, prompt_len=3, output_offset=0, max_tokens=4, presence_penalty=0.5,
                      frequency_penalty=-0.25, repetition_penalty=1.2, min_p=0.1, min_tokens=2, logprobs=3,
                      prompt_logprobs=0, logprobs_offset=10, prompt_logprobs_offset=100, extra_offset=3, extra=extra)
    FrontendPort(ring).submit(0, req, np.array([7, 8, 9]))
    assert ring.prompt_arena[:3].tolist() == [7, 8, 9]
    got = ring.slot_request(0)
    assert got.extra == SamplingExtra()   # the record alone: the extra lives in the arena
    assert dataclasses_equal(got, req)
    words = ring.prompt_arena[3:3 + 4]
    assert decode_extra(words, *extra.counts, vocab_size=10) == extra
    assert request_error(GEOM, ring.slots[0]) == ErrorCode.NONE
    plain = SlotRequest(seq=2, prompt_offset=0, prompt_len=1, output_offset=0, max_tokens=1)
    assert plain.logprobs == LOGPROBS_OFF and ring_record(plain)["flags"] == 0


def dataclasses_equal(a: SlotRequest, b: SlotRequest) -> bool:
    import dataclasses
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    da.pop("extra"), db.pop("extra")
    return {k: pytest.approx(v) if isinstance(v, float) else v for k, v in da.items()} == db


def ring_record(req: SlotRequest) -> np.void:
    return req.record()[0]


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", float("nan")), ("repetition_penalty", -1.0),
    ("min_p", 1.5), ("min_tokens", 5), ("logprobs", 21), ("extra_offset", 250),
    ("logprobs_offset", 500), ("prompt_logprobs_offset", 510),
])
def test_backend_rejects_out_of_range_sampling_fields(field, value):
    req = SlotRequest(seq=1, prompt_offset=0, prompt_len=3, output_offset=0, max_tokens=4, logprobs=2,
                      prompt_logprobs=1, extra=SamplingExtra(allowed_token_ids=tuple(range(8))))
    r = req.record()[0]
    assert request_error(GEOM, r) == ErrorCode.NONE
    r[field] = value
    assert request_error(GEOM, r) == ErrorCode.INVALID_REQUEST


def test_a_zeroed_record_asks_for_no_logprobs_and_no_penalty():
    r = np.zeros(1, SLOT_DTYPE)[0]
    r["prompt_len"], r["max_tokens"], r["top_p"] = 1, 1, 1.0
    assert request_error(GEOM, r) == ErrorCode.NONE
    req = SlotRequest.from_record(r)
    assert req.logprobs == LOGPROBS_OFF and req.prompt_logprobs == LOGPROBS_OFF


def test_logprob_records_precede_the_count():
    ring = _ring()
    req = SlotRequest(seq=1, prompt_offset=0, prompt_len=3, output_offset=0, max_tokens=4, logprobs=2,
                      prompt_logprobs=1, logprobs_offset=20, prompt_logprobs_offset=200)
    FrontendPort(ring).submit(1, req, np.array([1, 2, 3]))
    port = BackendPort(ring)
    port.claim(1)
    prompt = np.arange(2 * logprob_record_words(1), dtype="<i4").reshape(2, -1)
    port.publish_prompt_logprobs(1, prompt)
    rec = np.array([[np.float32(-0.5).view("<i4"), 1, 4, 5, np.float32(-0.5).view("<i4"),
                     np.float32(-1.0).view("<i4")]], "<i4")
    port.move(1, SlotState.DECODE_PROCESSING)
    port.publish(1, [4], logprob_records=rec)
    port.publish(1, [6], logprob_records=rec + 1)
    assert ring.slots[1]["generated"] == 2
    stride = logprob_record_words(2)
    assert ring.logprob_arena[20:20 + stride].tolist() == rec[0].tolist()
    assert ring.logprob_arena[20 + stride:20 + 2 * stride].tolist() == (rec[0] + 1).tolist()
    assert ring.logprob_arena[200:200 + prompt.size].tolist() == prompt.reshape(-1).tolist()
    with pytest.raises(ValueError, match="stride"):
        port.publish(1, [7], logprob_records=rec[:, :4])


def test_oversized_sampling_data_is_refused_before_it_is_parsed():
    from shared_layout.extra import MAX_LOGIT_BIAS
    n = MAX_LOGIT_BIAS + 1
    with pytest.raises(ValueError, match="larger"):
        decode_extra(np.zeros(2 * n, "<i4"), n, 0, 0, vocab_size=10)
