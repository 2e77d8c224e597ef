"""The doorbell: a datagram a host daemon sends a frontend on the same machine after a step."""
import select

import pytest

from shared_layout import doorbell
from shared_layout.doorbell import BellListener, Doorbell

pytestmark = pytest.mark.skipif(not doorbell.supported(), reason="abstract unix sockets are Linux-only")


def readable(fd: int, timeout_s: float) -> bool:
    return bool(select.select([fd], [], [], timeout_s)[0])


def test_a_ring_makes_the_listener_readable_and_drain_empties_it(ring_name):
    listener = BellListener.create(ring_name)
    bell = Doorbell(ring_name)
    try:
        assert not readable(listener.fileno(), 0.0)
        assert bell.ring() and bell.ring() and bell.ring()
        assert readable(listener.fileno(), 1.0)
        assert listener.drain() == 3
        assert not readable(listener.fileno(), 0.0) and listener.drain() == 0
    finally:
        bell.close()
        listener.close()


def test_without_a_listener_the_daemon_backs_off_then_finds_a_new_one(ring_name, monkeypatch):
    bell = Doorbell(ring_name)
    try:
        assert not bell.ring()                      # nobody bound: refused
        listener = BellListener.create(ring_name)
        assert not bell.ring()                      # still inside RETRY_S: not even tried
        assert listener.drain() == 0
        bell._retry_s = 1e-9                        # the retry time has passed
        assert bell.ring() and listener.drain() == 1
        listener.close()
    finally:
        bell.close()


def test_a_second_listener_on_the_same_ring_gets_none_and_rings_reach_the_first(ring_name):
    first = BellListener.create(ring_name)
    assert BellListener.create(ring_name) is None
    bell = Doorbell(ring_name)
    try:
        assert bell.ring() and first.drain() == 1
        first.close()                               # the name goes with the socket
        again = BellListener.create(ring_name)
        assert again is not None
        again.close()
    finally:
        bell.close()


def test_bells_of_other_rings_do_not_mix(ring_name):
    a, b = BellListener.create(ring_name), BellListener.create(ring_name + "-other")
    bell = Doorbell(ring_name + "-other")
    try:
        assert bell.ring()
        assert a.drain() == 0 and b.drain() == 1
    finally:
        bell.close()
        a.close()
        b.close()


def test_a_full_queue_drops_the_bell_without_blocking(ring_name):
    listener = BellListener.create(ring_name)
    bell = Doorbell(ring_name)
    try:
        sent = sum(bell.ring() for _ in range(5000))   # never drained: the queue fills
        assert 0 < sent < 5000
        assert not bell.ring()                          # full: dropped at once, a bell is pending
        assert listener.drain() == sent
        assert bell.ring()                              # room again
    finally:
        bell.close()
        listener.close()
