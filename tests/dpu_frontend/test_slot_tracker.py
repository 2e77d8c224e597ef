"""SlotTracker: availability cache, circular hint scan, held slots never offered."""
import numpy as np

from dpu_frontend.slot_tracker import SlotTracker
from shared_layout import SlotState


def states(*xs):
    return np.array(xs, "<u4")


def test_takes_circularly_from_the_hint():
    t = SlotTracker(4)
    t.refresh(states(0, 0, 0, 0))
    assert [t.take() for _ in range(4)] == [0, 1, 2, 3]
    assert t.take() is None and t.n_free == 0
    t.release(1)
    t.release(3)
    assert t.take() == 1          # hint wrapped to 0: first free from there
    assert t.take() == 3
    t.release(0)
    assert t.take() == 0


def test_refresh_only_offers_empty_unheld_slots():
    t = SlotTracker(5)
    t.refresh(states(SlotState.EMPTY, SlotState.DECODE_PROCESSING, SlotState.EMPTY,
                     SlotState.DECODE_COMPLETED, SlotState.PREFILL_PENDING))
    assert t.n_free == 2
    a = t.take()
    # a snapshot taken before our submit still shows the slot EMPTY: it stays ours
    t.refresh(states(0, 3, 0, 5, 1))
    assert t.n_free == 1 and t.take() == 2 and t.take() is None and a == 0


def test_untake_and_release_are_idempotent_on_counts():
    t = SlotTracker(3)
    t.refresh(states(0, 0, 0))
    s = t.take()
    t.untake(s)
    assert t.n_free == 3
    t.release(s)
    assert t.n_free == 3 and int(t.free.sum()) == 3
    assert not t.held.any()


def test_hint_scan_visits_every_slot_under_churn():
    rng = np.random.default_rng(0)
    t = SlotTracker(64)
    t.refresh(np.zeros(64, "<u4"))
    held = set()
    for _ in range(5000):
        if held and (rng.random() < 0.5 or t.n_free == 0):
            s = int(rng.choice(sorted(held)))
            held.remove(s)
            t.release(s)
        else:
            s = t.take()
            assert s is not None and s not in held
            held.add(s)
        assert t.n_free == 64 - len(held) == int(t.free.sum())
        assert set(np.flatnonzero(t.held).tolist()) == held


def test_version_moves_with_every_change_of_held():
    t = SlotTracker(4)
    t.refresh(np.zeros(4, np.uint32))
    v0 = t.version
    s = t.take()
    assert t.version == v0 + 1
    t.untake(s)
    assert t.version == v0 + 2
    s = t.take()
    t.release(s)
    assert t.version == v0 + 4
    t.release(s)                                   # already released: nothing changed
    t.refresh(np.zeros(4, np.uint32))
    assert t.version == v0 + 4
