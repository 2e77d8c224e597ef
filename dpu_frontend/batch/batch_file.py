"""The batch file format, as vLLM's `run-batch` (and OpenAI's Batch API) reads and writes it.

    input line:  {"custom_id": str, "method": "POST", "url": "/v1/chat/completions" |
                  "/v1/completions", "body": {the request as the endpoint takes it}}
        -> parse_line() -> BatchRequest, or BadLine (not JSON, no custom_id, another
           method or url, a body that is not an object, streaming, a repeated custom_id)
    output line: {"id": "batch_req_...", "custom_id": str | null,
                  "response": {"status_code": int, "request_id": str, "body": object | null},
                  "error": null | str | the server's error object}
        success: status 200, the endpoint's JSON body, error null;
        a bad line: status 400, body null, error the reason (vLLM's make_error_request_output);
        a server error: its status, body null, error its {"error": {...}} object.
    a rerun: keep_done() keeps the output lines that succeeded (rewriting the file without
        the others, atomically) and returns their custom_ids, which the run then skips.

Output lines are appended in completion order and flushed one by one (OutputFile), so a
killed run loses at most the requests in flight; a torn last line is dropped on the rerun.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import uuid
from typing import Any

URLS = ("/v1/chat/completions", "/v1/completions")


@dataclasses.dataclass(frozen=True)
class BatchRequest:
    line: int            # 1-based line number in the input file
    custom_id: str
    url: str             # one of URLS
    body: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class BadLine:
    line: int
    custom_id: str | None   # None when the line has none to give (not JSON, no custom_id)
    message: str


def parse_line(text: str, line: int) -> BatchRequest | BadLine:
    """One input line (without its newline) -> the request it asks for, or why it cannot run."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        return BadLine(line, None, f"line {line}: not JSON ({e})")
    if not isinstance(obj, dict):
        return BadLine(line, None, f"line {line}: a batch line must be a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(line, None, f"line {line}: 'custom_id' must be a non-empty string")
    method = obj.get("method", "POST")
    if method != "POST":
        return BadLine(line, custom_id, f"line {line}: method {method!r} is not supported (only POST)")
    url = obj.get("url")
    if url not in URLS:
        return BadLine(line, custom_id, f"line {line}: URL {url!r} is not supported "
                                        f"(supported: {', '.join(URLS)})")
    body = obj.get("body")
    if not isinstance(body, dict):
        return BadLine(line, custom_id, f"line {line}: 'body' must be a JSON object")
    if body.get("stream"):
        return BadLine(line, custom_id, f"line {line}: a batch request must not be sent in stream mode")
    return BatchRequest(line, custom_id, url, body)


def read_requests(path: str | os.PathLike) -> list[BatchRequest | BadLine]:
    """Every non-blank line of the input file, in file order; a custom_id seen before is a BadLine."""
    out: list[BatchRequest | BadLine] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, text in enumerate(f, start=1):
            text = text.strip()
            if not text:
                continue
            item = parse_line(text, number)
            if isinstance(item, BatchRequest):
                if item.custom_id in seen:
                    item = BadLine(number, item.custom_id,
                                   f"line {number}: custom_id {item.custom_id!r} was used by an earlier line")
                else:
                    seen.add(item.custom_id)
            out.append(item)
    return out


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def response_line(custom_id: str | None, status_code: int, body: Any = None, error: Any = None,
                  request_id: str | None = None) -> dict[str, Any]:
    """One output line; request_id defaults to the response body's id when it has one."""
    if request_id is None:
        request_id = body["id"] if isinstance(body, dict) and isinstance(body.get("id"), str) \
            else _new_id("blink-batch-")
    return {"id": _new_id("batch_req_"), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body},
            "error": error}


def bad_line_output(bad: BadLine) -> dict[str, Any]:
    return response_line(bad.custom_id, 400, None, bad.message)


def is_done(record: Any) -> bool:
    """A line a rerun need not repeat: a custom_id answered 200 with a body and no error."""
    if not isinstance(record, dict) or not isinstance(record.get("custom_id"), str):
        return False
    response = record.get("response")
    return (record.get("error") is None and isinstance(response, dict)
            and response.get("status_code") == 200 and response.get("body") is not None)


def keep_done(path: str | os.PathLike) -> set[str]:
    """The custom_ids an earlier run of this output file answered; the file keeps only those
    lines (failed, unreadable and torn lines go: their requests run again). Missing file: none."""
    path = pathlib.Path(path)
    if not path.exists():
        return set()
    kept: list[str] = []
    done: set[str] = set()
    dropped = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for text in f:
            text = text.strip()
            if not text:
                continue
            try:
                record = json.loads(text)
            except ValueError:
                dropped += 1
                continue
            if is_done(record) and record["custom_id"] not in done:
                done.add(record["custom_id"])
                kept.append(text)
            else:
                dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(t + "\n" for t in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)   # all or nothing: a crash here leaves the old file whole
    return done


class OutputFile:
    """The output file opened for appending; each line is flushed as it is written."""

    def __init__(self, path: str | os.PathLike):
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "OutputFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
