"""How the two polling sides wait: short sleeps that end close to when they were asked to.

Both sides poll the ring and sleep in between: the frontend's token reader for ~10 us
while tokens flow (RingClient._sleep), the daemon's engine loop for 50 us and up while
the ring is quiet (Engine.serve). Linux stretches every sleep of a normal thread by its
timer slack, 50 us by default, which here doubled the reader's fine waits and added
most of the daemon's pick-up delay for a new request. fine_timer_slack() sets the
calling thread's slack to TIMER_SLACK_NS (prctl PR_SET_TIMERSLACK); each side calls it
in the thread that polls. Elsewhere than Linux nothing changes.
"""
from __future__ import annotations

import ctypes
import sys

TIMER_SLACK_NS = 1000
_PR_SET_TIMERSLACK = 29


def fine_timer_slack(slack_ns: int = TIMER_SLACK_NS) -> bool:
    """Let this thread's sleeps end within slack_ns of their due time; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, slack_ns, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
