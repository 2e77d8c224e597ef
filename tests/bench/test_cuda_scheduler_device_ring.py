"""bench.cuda_scheduler's device-ring workload, its host side only: the ring formatted and filled on
the host lands whole at the device ring's address, the slots are read back from the right offsets
until every request completed, and the outputs are checked against the echo. The GPU is stood in
for by host memory and a runtime that serves the echo the way blink_echo_step does; what the
device does is measured only on a lent GPU (the plan's first call). This guards the offsets and
the polling, so a lent minute is not lost to a slip here."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

cuda_scheduler = pytest.importorskip("bench.cuda_scheduler")
from shared_layout import Ring, RingGeometry, SlotState  # noqa: E402

MEMORY: dict[int, np.ndarray] = {}     # base address -> the fake device buffer


def _at(addr: int, n: int) -> np.ndarray:
    for base, buf in MEMORY.items():
        if base <= addr and addr + n <= base + buf.nbytes:
            return buf[addr - base:addr - base + n]
    raise AssertionError(f"{n} bytes at {addr:#x} fall outside every device buffer")


class FakeDriver:
    def cuMemcpyHtoD(self, dst, src, n):
        _at(dst, n)[:] = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(src))
        return (0,)

    def cuMemcpyDtoH(self, dst, src, n):
        np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(dst))[:] = _at(src, n)
        return (0,)


class FakeDeviceRing:
    def __init__(self, geom: RingGeometry):
        self.buf = np.zeros(geom.total_size, np.uint8)
        self.device_addr = 0x7000_0000_0000 + (len(MEMORY) << 32)
        MEMORY[self.device_addr] = self.buf
        self.closed = False

    def close(self):
        self.closed = True


class EchoRuntime:
    """Serves every pending slot of the ring at its address as the echo step graph does."""
    instances: list["EchoRuntime"] = []

    def __init__(self, device, cfg, geom, ring_addr, module):
        self.ring = Ring(_at(ring_addr, geom.total_size), geom)
        EchoRuntime.instances.append(self)

    def start(self):
        r = self.ring
        for i in np.nonzero(r.state == SlotState.PREFILL_PENDING)[0]:
            s = r.slots[i]
            prompt = r.prompt_arena[s["prompt_offset"]:s["prompt_offset"] + s["prompt_len"]]
            r.output_arena[s["output_offset"]:s["output_offset"] + s["max_tokens"]] = \
                [prompt[k % len(prompt)] for k in range(s["max_tokens"])]
            r.slots["generated"][i] = s["max_tokens"]
            r.state[i] = SlotState.DECODE_COMPLETED

    def request_stop(self):
        pass

    def wait(self, timeout_s):
        return True

    def stats(self):
        class S:
            counters = {"steps_prefill": 1, "steps_decode": 15, "windows": 1, "scan_ns": 16_000, "scans": 16,
                        "publish_ns": 8_000, "plan_ns": 8_000, "launch_ns": 4_000, "wait_ns": 1_000}
        return S()

    def close(self):
        pass


@pytest.fixture(autouse=True)
def fresh_memory():
    MEMORY.clear()
    yield
    MEMORY.clear()


def test_the_device_ring_workload_reads_and_checks_the_right_bytes(monkeypatch):
    monkeypatch.setattr(cuda_scheduler, "DeviceRing", FakeDeviceRing)
    monkeypatch.setattr(cuda_scheduler, "SchedulerRuntime", EchoRuntime)
    monkeypatch.setattr(cuda_scheduler, "check", lambda res, what="": None)
    bench = object.__new__(cuda_scheduler.Bench)
    bench.d, bench.device, bench.module = FakeDriver(), None, None
    n_req, prompt_len, tokens = 64, 16, 32
    geom = RingGeometry(4096, max(1 << 16, n_req * prompt_len), max(1 << 16, n_req * tokens))
    res = bench._device_ring(geom, None, n_req, prompt_len, tokens)
    assert res["steps"] == 16 and res["scan_us_per_iteration"] == 1.0 and res["makespan_ms"] >= 0
    dev = Ring(next(iter(MEMORY.values())), geom)
    assert (dev.state[:n_req] == SlotState.DECODE_COMPLETED).all() and (dev.state[n_req:] == 0).all()
    assert int(dev.header["magic"]) != 0                      # formatted on the host, copied whole


def test_a_wrong_echo_fails_the_check(monkeypatch):
    class WrongRuntime(EchoRuntime):
        def start(self):
            super().start()
            self.ring.output_arena[3] += 1
    monkeypatch.setattr(cuda_scheduler, "DeviceRing", FakeDeviceRing)
    monkeypatch.setattr(cuda_scheduler, "SchedulerRuntime", WrongRuntime)
    monkeypatch.setattr(cuda_scheduler, "check", lambda res, what="": None)
    bench = object.__new__(cuda_scheduler.Bench)
    bench.d, bench.device, bench.module = FakeDriver(), None, None
    geom = RingGeometry(4096, 1 << 16, 1 << 16)
    with pytest.raises(AssertionError, match=r"requests \[0\] \(of 1\): wrong tokens"):
        bench._device_ring(geom, None, 8, 16, 32)
