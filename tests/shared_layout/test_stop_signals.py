"""stop_on_signals: a signal sets the Event from the watcher thread, the handler takes no lock (a
signal landing while the Event's lock is held by the main thread, as in a nested handler, does not
hang), a burst of signals is one stop, and restore() puts the previous handlers back. Each case runs in
a fresh interpreter so pytest's own handlers are never touched, with a timeout that fails a hang."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent("""
    import os, signal, threading, time
    from shared_layout.stop_signals import stop_on_signals
    stop = threading.Event()
    restore = stop_on_signals(stop)
""")


def _default_dispositions() -> None:
    """In the child before exec: SIGINT and SIGTERM at their default action, as a terminal starts a
    process. A runner that ignores them (a shell's `cmd &` without job control ignores SIGINT, and
    children inherit that) would otherwise start Python without its KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=30, preexec_fn=_default_dispositions)


def test_sigterm_sets_the_event():
    p = run("""
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(5), "not set"
        restore()
        print("ok")
    """)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_a_signal_while_the_events_lock_is_held_does_not_hang():
    """What hung `blink serve`: the handler ran while Event.set() held the Event's Condition lock on the
    main thread. Here the main thread holds that lock and signals itself twice; the handlers return,
    and the Event is set once the lock is released."""
    p = run("""
        with stop._cond:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)                       # the handlers run here, under the held lock
        assert stop.wait(5), "not set"
        restore()
        print("ok")
    """)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_a_burst_of_signals_is_one_stop_and_restore_brings_back_the_old_handlers():
    p = run("""
        for _ in range(500):
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(5)
        restore()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert not any(t.name == "stop-signals" for t in threading.enumerate())
        print("ok")
    """)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_after_restore_the_default_action_applies(sig):
    p = run(f"""
        restore()
        os.kill(os.getpid(), signal.{sig})
        time.sleep(1)
        print("survived")
    """)
    assert "survived" not in p.stdout
