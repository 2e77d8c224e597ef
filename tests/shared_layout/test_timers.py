"""fine_timer_slack: the calling thread's sleeps end within the slack asked for (Linux)."""
import ctypes
import sys
import threading

from shared_layout.timers import TIMER_SLACK_NS, fine_timer_slack


def test_fine_timer_slack_applies_to_the_calling_thread_only():
    if not sys.platform.startswith("linux"):
        assert fine_timer_slack() is False
        return
    libc = ctypes.CDLL(None)
    got = {}

    def in_thread():   # a thread of its own: the test process keeps its slack
        before = libc.prctl(30, 0, 0, 0, 0)   # PR_GET_TIMERSLACK
        got["ok"] = fine_timer_slack(2000)
        got["slack"] = (before, libc.prctl(30, 0, 0, 0, 0))
    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert got["ok"] and got["slack"] == (got["slack"][0], 2000) and got["slack"][0] != 2000
    assert libc.prctl(30, 0, 0, 0, 0) != 2000   # this thread untouched
    assert TIMER_SLACK_NS <= 1000


def test_the_frontend_loop_and_the_daemon_engine_set_it():
    from dpu_frontend import http_server
    from gpu_backend import engine
    assert http_server.fine_timer_slack is fine_timer_slack and engine.fine_timer_slack is fine_timer_slack

    async def slack():
        return ctypes.CDLL(None).prctl(30, 0, 0, 0, 0) if sys.platform.startswith("linux") else None
    got = {}
    t = threading.Thread(target=lambda: got.update(v=http_server.run(slack(), "asyncio")))
    t.start()
    t.join()
    assert got["v"] in (TIMER_SLACK_NS, None)
