"""Security: the optional API key (Bearer, constant-time, 401 JSON, /health and /metrics open
unless configured), loopback bind by default, the ring file 0600, and no prompts or keys in
process arguments or logs unless a debug setting asks for prompts."""
from __future__ import annotations

import hmac
import os
import stat

import openai
import pytest

from bench.reliability import ServeUnderTest, children_of, http_get
from dpu_frontend import auth
from dpu_frontend.config import FrontendConfig
from rel_procs import post

KEY = "sk-test-7f3a9c1e5b2d4068a1b3c5d7e9f1a2b3"
SECRET = "xyzzy-secret-prompt-4711"


def test_bearer_matching_uses_a_constant_time_compare(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)
    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    key = KEY.encode()
    assert auth.bearer_matches(f"Bearer {KEY}", key)
    assert auth.bearer_matches(f"bearer   {KEY}  ", key)
    assert len(calls) == 2
    for header in (None, "", KEY, f"Basic {KEY}", f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", "Bearer é", "Bearer"):
        assert not auth.bearer_matches(header, key), header
    assert not auth.protected("/health", False) and auth.protected("/health", True)
    assert auth.protected("/v1/models", False) and auth.protected("/anything-else", False)


def test_the_key_stays_out_of_reprs_and_bad_keys_are_refused():
    c = FrontendConfig(api_key=KEY)
    assert KEY not in repr(c) and KEY not in str(c)
    for bad in ("", " padded", "two words\n", "ключ"):
        with pytest.raises(ValueError) as e:
            FrontendConfig(api_key=bad)
        assert bad.strip() not in str(e.value) or not bad.strip()
    assert FrontendConfig().host == "127.0.0.1"


def _listen_addresses(port: int) -> set[str]:
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, st = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and st == "0A":   # LISTEN
                out.add(addr)
    return out


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """blink serve with the key in its environment and debug logging on."""
    os.environ["BLINK_API_KEY"] = KEY
    try:
        s = ServeUnderTest(f"blink-test-sec-{os.getpid()}", ["--model", "null", "--log-level", "debug"],
                           tmp_path_factory.mktemp("sec") / "serve.log", ready_timeout_s=120)
    finally:
        del os.environ["BLINK_API_KEY"]
    yield s
    assert s.stop() == 0


@pytest.mark.slow
def test_api_key_required_on_v1_only(keyed):
    base = keyed.base
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        status, err, h = post(base, "/v1/completions", {"prompt": [5], "max_tokens": 2}, headers=headers)
        assert status == 401 and err["error"]["type"] == "AuthenticationError" and h.get("WWW-Authenticate")
        assert KEY not in str(err)
    assert http_get(base + "/v1/models")[0] == 401
    assert http_get(base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})[0] == 200
    for open_path in ("/health", "/metrics", "/openapi.json"):
        assert http_get(base + open_path)[0] == 200, open_path
    status, reply, _ = post(base, "/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True},
                            headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200 and reply["usage"]["completion_tokens"] == 3
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="null", prompt=[5, 6], max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()
    assert keyed.metrics()['blink_requests_total{endpoint="completions",outcome="unauthorized"}'] == 3


@pytest.mark.slow
def test_no_key_in_argv_no_prompt_or_key_in_logs_loopback_and_ring_0600(keyed):
    status, _, _ = post(keyed.base, "/v1/completions", {"prompt": SECRET, "max_tokens": 4},
                        headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200
    status, _, _ = post(keyed.base, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 2, "bogus": SECRET},
                        headers={"Authorization": f"Bearer {KEY}"})
    assert status == 400
    post(keyed.base, "/v1/completions", {"prompt": SECRET}, headers={"Authorization": f"Bearer {SECRET}"})
    for pid, cmd in children_of(keyed.proc.pid) + [(keyed.proc.pid, "")]:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert KEY.encode() not in f.read(), pid
    log = keyed.log_path.read_text()
    assert "DEBUG" in log or "debug" in log.lower()
    assert SECRET not in log and KEY not in log
    assert _listen_addresses(keyed.port) == {"0100007F"}                    # 127.0.0.1 only
    mode = stat.S_IMODE(os.stat(f"/dev/shm/{keyed.ring}").st_mode)
    assert mode == 0o600, oct(mode)


@pytest.mark.slow
def test_auth_all_routes_and_log_prompts(tmp_path):
    # --api-key on serve's own command line: the frontend child gets it through its environment.
    # serve probes /health itself: with --auth-all-routes it sends the key, so it still gets ready.
    s = ServeUnderTest(f"blink-test-sec2-{os.getpid()}",
                       ["--model", "null", "--api-key", KEY, "--auth-all-routes", "--log-prompts"],
                       tmp_path / "serve.log", ready_timeout_s=120, headers={"Authorization": f"Bearer {KEY}"})
    try:
        with open(f"/proc/{s.frontend_pid}/cmdline", "rb") as f:
            assert KEY.encode() not in f.read()
        auth_header = {"Authorization": f"Bearer {KEY}"}
        for path in ("/health", "/metrics", "/openapi.json", "/v1/models"):
            assert http_get(s.base + path)[0] == 401, path
            assert http_get(s.base + path, headers=auth_header)[0] == 200, path
        status, _, _ = post(s.base, "/v1/completions", {"prompt": SECRET, "max_tokens": 2}, headers=auth_header)
        assert status == 200
        assert SECRET in s.log_path.read_text()                             # asked for: logged
        assert KEY not in s.log_path.read_text()
    finally:
        assert s.stop() == 0
