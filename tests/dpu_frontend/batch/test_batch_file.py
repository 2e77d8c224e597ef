"""The batch file format: input lines to requests or bad lines, output lines in vLLM's shape, and
what a rerun keeps of an earlier output file."""
from __future__ import annotations

import json

import pytest

from dpu_frontend.batch.batch_file import (BadLine, BatchRequest, OutputFile, bad_line_output, is_done, keep_done,
                                           parse_line, read_requests, response_line)

CHAT = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}


def test_a_chat_line_and_a_completions_line_parse_to_requests():
    r = parse_line(json.dumps(CHAT), 1)
    assert r == BatchRequest(1, "r1", "/v1/chat/completions", CHAT["body"])
    line = {"custom_id": "r2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    assert parse_line(json.dumps(line), 7) == BatchRequest(7, "r2", "/v1/completions", {"prompt": "x"})


@pytest.mark.parametrize("text, custom_id, why", [
    ("not json", None, "not JSON"),
    ("[1, 2]", None, "JSON object"),
    (json.dumps({**CHAT, "custom_id": ""}), None, "custom_id"),
    (json.dumps({k: v for k, v in CHAT.items() if k != "custom_id"}), None, "custom_id"),
    (json.dumps({**CHAT, "custom_id": 5}), None, "custom_id"),
    (json.dumps({**CHAT, "method": "GET"}), "r1", "method"),
    (json.dumps({**CHAT, "url": "/v1/embeddings"}), "r1", "/v1/embeddings"),
    (json.dumps({**CHAT, "body": "hello"}), "r1", "body"),
    (json.dumps({**CHAT, "body": {**CHAT["body"], "stream": True}}), "r1", "stream"),
])
def test_bad_lines_name_their_custom_id_when_they_have_one(text, custom_id, why):
    bad = parse_line(text, 3)
    assert isinstance(bad, BadLine) and bad.custom_id == custom_id and bad.line == 3
    assert why in bad.message and bad.message.startswith("line 3:")


def test_read_requests_skips_blank_lines_and_refuses_a_repeated_custom_id(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text(json.dumps(CHAT) + "\n\n   \n" + "oops\n" + json.dumps(CHAT) + "\n")
    items = read_requests(p)
    assert [type(i).__name__ for i in items] == ["BatchRequest", "BadLine", "BadLine"]
    assert [i.line for i in items] == [1, 4, 5]
    assert items[2].custom_id == "r1" and "earlier line" in items[2].message


def test_output_lines_have_vllms_fields():
    body = {"id": "chatcmpl-1", "object": "chat.completion", "choices": []}
    ok = response_line("r1", 200, body)
    assert set(ok) == {"id", "custom_id", "response", "error"}
    assert set(ok["response"]) == {"status_code", "request_id", "body"}
    assert ok["response"] == {"status_code": 200, "request_id": "chatcmpl-1", "body": body}
    assert ok["error"] is None and ok["id"].startswith("batch_req_")
    bad = bad_line_output(BadLine(2, "r2", "line 2: nope"))
    assert bad["custom_id"] == "r2" and bad["error"] == "line 2: nope"
    assert bad["response"]["status_code"] == 400 and bad["response"]["body"] is None
    assert bad["response"]["request_id"]   # always one, as vLLM writes it
    assert response_line("r1", 200, body)["id"] != ok["id"]


def test_only_an_answered_line_counts_as_done():
    body = {"id": "x", "choices": []}
    assert is_done(response_line("a", 200, body))
    assert not is_done(response_line("a", 400, None, "bad"))
    assert not is_done(response_line("a", 503, None, {"error": {"message": "full"}}))
    assert not is_done(response_line(None, 200, body))
    assert not is_done(["a"])


def test_keep_done_keeps_answered_lines_and_drops_failed_and_torn_ones(tmp_path):
    out = tmp_path / "out.jsonl"
    ok_a = response_line("a", 200, {"id": "1"})
    ok_b = response_line("b", 200, {"id": "2"})
    with OutputFile(out) as f:
        f.write(ok_a)
        f.write(response_line("c", 400, None, "bad"))
        f.write(ok_b)
        f.write(response_line("a", 200, {"id": "3"}))   # a second answer for a: the first one stays
    with open(out, "a") as f:
        f.write('{"id": "batch_req_torn", "custom_id": "d", "resp')   # killed mid-line
    assert keep_done(out) == {"a", "b"}
    assert [json.loads(t) for t in out.read_text().splitlines()] == [ok_a, ok_b]
    assert not (tmp_path / "out.jsonl.tmp").exists()
    assert keep_done(out) == {"a", "b"}   # nothing more to drop: the file is left as it is
    assert keep_done(tmp_path / "missing.jsonl") == set()


def test_output_file_appends_and_each_line_is_readable_before_close(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(response_line("old", 200, {"id": "0"})) + "\n")
    f = OutputFile(out)
    f.write(response_line("new", 200, {"id": "1"}))
    lines = out.read_text().splitlines()   # flushed: another process sees it while the run goes on
    f.close()
    assert [json.loads(t)["custom_id"] for t in lines] == ["old", "new"]
