"""WakeupTimer: a real timerfd, watched the way the event loop watches it (select on the fd)."""
import select
import sys

import pytest

from dpu_frontend.wakeup_timer import WakeupTimer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux only")


def readable(fd: int, timeout_s: float) -> bool:
    return bool(select.select([fd], [], [], timeout_s)[0])


@pytest.fixture
def timer():
    t = WakeupTimer.create()
    assert t is not None
    yield t
    t.close()


def test_an_armed_timer_turns_readable_once(timer):
    assert not readable(timer.fd, 0) and not timer.consume()   # unarmed: nothing to take
    timer.arm(0.002)
    assert readable(timer.fd, 5.0)
    assert timer.consume()
    assert not readable(timer.fd, 0.01) and not timer.consume()   # one-shot: no second expiry


def test_a_zero_or_past_time_expires_at_once(timer):
    timer.arm(0.0)
    assert readable(timer.fd, 5.0) and timer.consume()
    timer.arm(-1.0)
    assert readable(timer.fd, 5.0) and timer.consume()


def test_re_arming_drops_an_expiry_nobody_took(timer):
    """A wait woken early leaves its expiry behind; the next wait's arm must not inherit it."""
    timer.arm(0.0)
    assert readable(timer.fd, 5.0)       # expired, not consumed
    timer.arm(60.0)
    assert not readable(timer.fd, 0.01) and not timer.consume()


def test_close_is_idempotent():
    t = WakeupTimer.create()
    t.close()
    t.close()
    assert t.fd == -1
