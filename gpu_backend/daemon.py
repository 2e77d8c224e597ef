"""The daemon: one-time setup, then hand the ring over to an executor.

    resolve the executor (one-line error and exit 2 if it cannot run here)
    -> open_ring (attach or create the shm file) [-> RDMA bootstrap server over
       it with --transport verbs] -> begin: STARTING, epoch + 1,
       leftover slots of a dead daemon aborted -> heartbeat thread
    -> executor = spec.create(options) (loads the model)
    -> publish vocab / max_len, READY -> executor.serve(ring, stop)
    -> stop (SIGTERM, SIGINT or the header's shutdown word): STOPPING, grace
       period, leftovers ABORT/BACKEND_SHUTDOWN, DOWN, exit 0.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import sys
import threading

from shared_layout import RingGeometry
from shared_layout.stop_signals import stop_on_signals

from . import ring_host
from .executors import ExecutorOptions, resolve
from .heartbeat import Heartbeat

log = logging.getLogger("blink.gpu_daemon")


@dataclasses.dataclass(frozen=True)
class DaemonConfig:
    ring_name: str = "blink-ring"
    geometry: RingGeometry | None = None    # None: adopt an existing ring's, else the default
    executor: str = "cpu"
    options: ExecutorOptions = ExecutorOptions()
    heartbeat_interval_s: float = 0.05
    rdma: object | None = None              # rdma_server.RdmaServerConfig for --transport verbs


def _say(msg: str) -> None:
    print(f"blink gpu-daemon: {msg}", file=sys.stderr, flush=True)


def run_daemon(config: DaemonConfig) -> int:
    spec = resolve(config.executor, config.options.model)
    why = spec.unavailable_reason()
    if why is not None:
        _say(f"--executor {config.executor} needs {spec.requirement}; none found ({why})")
        return 2
    try:
        region, ring = ring_host.open_ring(config.ring_name, config.geometry)
    except ring_host.RingError as e:
        _say(str(e))
        return 2
    rdma_server = None
    if config.rdma is not None:       # remote frontends reach the host ring over RDMA
        from .rdma_server import serve_host_ring
        try:
            rdma_server = serve_host_ring(config.rdma, region.buf, ring.geom.total_size)
        except SystemExit as e:
            _say(str(e).removeprefix("blink gpu-daemon: "))
            region.close()
            return 2
    stop = threading.Event()
    restore_signals = stop_on_signals(stop)      # SIGTERM / SIGINT set `stop` (no lock in the handler)
    epoch = ring_host.begin(ring)
    beat = Heartbeat(ring, stop, config.heartbeat_interval_s)
    beat.start()
    executor, rc = None, 0
    try:
        try:
            # A host loop rings the ring's doorbell for a frontend on this host (shared_layout.doorbell).
            executor = spec.create(dataclasses.replace(config.options, doorbell=config.ring_name))
        except Exception as e:   # bad model path, unreadable file: one line, no traceback
            _say(f"cannot load model {config.options.model!r}: {e}")
            return 1
        # Everything alive now (the model's modules, the tokenizer's and config's objects) lives as
        # long as the daemon: out of the cyclic collector's sight, a step's allocations no longer
        # make it walk them (its passes were ~7% of a batch-1 decode step's perf samples, Q4_1
        # SmolLM2 on the AVX2 EPYC; vLLM freezes after start-up too). Before READY: it takes a while.
        gc.collect()
        gc.freeze()
        ring_host.publish_model(ring, executor.vocab_size, executor.max_model_len)
        log.info("ready: ring %s (%d slots), epoch %d, executor %s, vocab %d, max_len %d",
                 config.ring_name, ring.geom.slot_count, epoch, executor.name, executor.vocab_size,
                 executor.max_model_len)
        if not stop.is_set():
            executor.serve(ring, stop)
        log.info("stopping")
    except Exception:
        log.exception("executor failed")
        rc = 1
    finally:
        beat.halt()
        n = ring_host.end(ring)
        if n:
            log.info("%d requests ended ABORT/BACKEND_SHUTDOWN", n)
        if executor is not None:
            executor.close()
        if rdma_server is not None:
            rdma_server.close()
        restore_signals()
        region.close()
    return rc
