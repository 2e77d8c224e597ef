"""CUDA scheduler benchmark (needs a GPU of compute capability >= 9.0): the
control-plane costs of the persistent scheduler, each against its host-side
counterpart measured in the same run.

    scan      blink_bench_scan: one scan of every slot's state word, ring in device
              memory and host-mapped (paper: 1-5 us for 4096 slots)
    launch    blink_bench_launch inside a device graph: fire-and-forget launch of a
              one-kernel graph (API call, launch -> child start, launch -> child done
              seen) vs cuGraphLaunch of the same graph from the host (paper: ~2 us
              vs 11-17 us); blink_bench_tail: a tail self-relaunch
    ops       blink_bench_ops: what thread 0 strings together between two steps, one kind at a
              time, ns each (a clock read, a load of device memory plain / volatile / block-scope,
              a ring word over PCIe, a ring store + system fence, the fences alone, the block's
              barrier, a shared atomic): the terms the loop's per-step overhead is a sum of
    workload  the stand-in echo workload (R requests x T tokens, or mixed lengths, batch B) served by
              the persistent scheduler vs by a host-driven loop (the same C++ loop on
              a host thread that launches the same echo graph from the host each
              step and waits for it): makespan, per-step time and scheduler overhead;
              the persistent scheduler also over a ring in device memory (the DPU
              deployment), whose slot scan and publish stay on the device

    python -m bench.cuda_scheduler [--machine h100] [--out DIR]
      -> DIR/<date>-<machine>-cuda_scheduler.json + .md (DIR: $OUT if set, else bench/results)
"""
from __future__ import annotations

import argparse
import dataclasses
import ctypes
import json
import os
import pathlib
import statistics
import time

import numpy as np

from gpu_backend.cuda import driver, structs
from gpu_backend.cuda.config import SchedulerConfig
from gpu_backend.cuda.device_ring import DeviceRing
from gpu_backend.cuda.driver import bindings, check
from gpu_backend.cuda.runtime import KernelArgs, Module, PinnedMapped, SchedulerRuntime, calibrate_clock
from shared_layout import Ring, RingGeometry, SlotRequest, SlotState, fence

from .machine_label import machine_label

DATE = time.strftime("%Y-%m-%d", time.gmtime())    # the run's day: results are committed under it
LAUNCHES_PER_WINDOW = 100     # below the 120 fire-and-forget launches a graph execution may make
# blink_bench_ops' kinds, in bench.cu's BLINK_OPS_* order: (key, what the report calls it)
OPS = (("clock", "%globaltimer read, 64 bits"),
       ("ld_dev", "load, device memory, plain (a chain: each address from the load before)"),
       ("ld_dev_volatile", "load, device memory, volatile"),
       ("ld_dev_cta", "load, device memory, relaxed block scope (ld_blk32)"),
       ("st_ld_dev", "store to device memory, then a load of that word (a counter's += 1)"),
       ("ld_shared", "load, shared memory"),
       ("ld_shared_generic", "load, shared memory through a generic pointer (shared_state's state, stats, pkv)"),
       ("ld_host", "load, host-mapped (a ring word over PCIe), volatile"),
       ("st_host_fence_sys", "store to host-mapped + __threadfence_system (publish, each token)"),
       ("st_dev_fence_sys", "store to device memory + __threadfence_system (the DPU's ring)"),
       ("fence_sys", "__threadfence_system, no store pending"),
       ("fence_dev", "store to device memory + __threadfence"),
       ("sync", "__syncthreads, 256 threads"),
       ("atomic_shared", "atomicAdd_block on shared memory (a chain)"),
       ("st_host_fence_acqrel_sys", "store to host-mapped + fence.acq_rel.sys (__threadfence_system is fence.sc.sys)"),
       ("fence_acqrel_sys", "fence.acq_rel.sys, no store pending"),
       ("fence_acqrel_dev", "store to device memory + fence.acq_rel.gpu (__threadfence is fence.sc.gpu)"),
       ("st_release_host", "st.release.sys to host-mapped (a release store, no fence of its own)"),
       ("ld_acquire_dev", "ld.acquire.gpu of device memory, a chain (an acquire load, no fence of its own)"))


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary_us(ns_values) -> dict:
    us = [v / 1e3 for v in ns_values]
    return {"median_us": round(statistics.median(us), 3), "p10_us": round(_pct(us, 0.1), 3),
            "p90_us": round(_pct(us, 0.9), 3), "n": len(us)}


class Bench:
    def __init__(self):
        self.d = bindings()
        self.device = driver.open_device(0)
        self.module = Module()
        self.stream = check(self.d.cuStreamCreate(int(self.d.CUstream_flags.CU_STREAM_NON_BLOCKING)))
        self.state_ab_error = None   # the shared_state A/B failed once: the later workloads skip it

    def sync(self):
        check(self.d.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def dev_alloc(self, nbytes: int) -> int:
        addr = int(check(self.d.cuMemAlloc(nbytes), "cuMemAlloc"))
        check(self.d.cuMemsetD8(addr, 0, nbytes))
        return addr

    def dtoh(self, addr: int, n: int, dtype=np.uint64) -> np.ndarray:
        out = np.empty(n, dtype)
        check(self.d.cuMemcpyDtoH(out.ctypes.data, addr, out.nbytes), "cuMemcpyDtoH")
        return out

    def params_block(self, geom: RingGeometry, ring_addr: int) -> int:
        p = SchedulerConfig(max_batch_size=1).params(geom, ring_addr, {}, 0)
        addr = self.dev_alloc(ctypes.sizeof(p))
        check(self.d.cuMemcpyHtoD(addr, ctypes.addressof(p), ctypes.sizeof(p)))
        return addr

    # -- scan --------------------------------------------------------------------
    def scan(self, slots: int = 4096, reps: int = 2000) -> dict:
        geom = RingGeometry(slots, 1 << 16, 1 << 16)
        out = self.dev_alloc(8 * reps)
        res = {}
        dring = DeviceRing(geom)
        host = Ring.create(bytearray(geom.total_size), geom)
        mapped_mem = PinnedMapped(geom.total_size)
        hring = Ring.create((ctypes.c_char * geom.total_size).from_address(mapped_mem.host_addr), geom)
        for name, addr in (("device_memory", dring.device_addr), ("host_mapped", mapped_mem.device_addr)):
            p = self.params_block(geom, addr)
            args = KernelArgs(p, out, reps)
            self.module.launch("blink_bench_scan", self.stream, args, block=256)   # warm-up
            self.sync()
            self.module.launch("blink_bench_scan", self.stream, args, block=256)
            self.sync()
            res[name] = summary_us(self.dtoh(out, reps)[1:])
        del host, hring
        dring.close()
        mapped_mem.close()
        return {"slots": slots, "threads": 256, **res}

    # -- launch latency ----------------------------------------------------------
    def launch(self, windows: int = 20) -> dict:
        d = self.d
        flag = self.dev_alloc(8)
        starts = self.dev_alloc(8 * (LAUNCHES_PER_WINDOW + 1))
        children = [self.module.device_graph("blink_bench_child", self.stream, KernelArgs(flag, starts))
                    for _ in range(2)]
        child_tab = self.dev_alloc(16)
        tab = np.array([int(e) for _, e in children], np.uint64)
        check(d.cuMemcpyHtoD(child_tab, tab.ctypes.data, 16))
        out = self.dev_alloc(8 * 4 * LAUNCHES_PER_WINDOW)
        parent = self.module.device_graph("blink_bench_launch", self.stream,
                                          KernelArgs(child_tab, 2, flag, out, LAUNCHES_PER_WINDOW))
        call, start, rtt, errors = [], [], [], 0
        for w in range(windows + 1):
            check(d.cuMemsetD8(flag, 0, 8))
            check(d.cuGraphLaunch(parent[1], self.stream), "cuGraphLaunch(bench parent)")
            self.sync()
            o = self.dtoh(out, 4 * LAUNCHES_PER_WINDOW).reshape(-1, 4)
            s = self.dtoh(starts, LAUNCHES_PER_WINDOW)
            errors += int(((o[:, 3] & 0xFFFFFFFF) != 0).sum())
            if w == 0:
                continue   # warm-up
            call += o[:, 0].tolist()
            rtt += o[:, 1].tolist()
            start += (s.astype(np.int64) - o[:, 2].astype(np.int64)).tolist()
        device = {"api_call": summary_us(call), "launch_to_child_start": summary_us(start),
                  "launch_to_done_seen": summary_us(rtt), "launch_errors": errors}

        # the same child graph launched from the host; completion seen through host-mapped memory
        hflag = PinnedMapped(8)
        hstarts = self.dev_alloc(8 * 4096)
        hchild = self.module.device_graph("blink_bench_child", self.stream, KernelArgs(hflag.device_addr, hstarts))
        offset = calibrate_clock(self.module, self.stream)
        flag_view = ctypes.c_uint32.from_address(hflag.host_addr)
        h_call, h_rtt, h_t0 = [], [], []
        n = windows * 50
        for i in range(n + 20):
            t0 = time.monotonic_ns()
            check(d.cuGraphLaunch(hchild[1], self.stream), "cuGraphLaunch(host)")
            t1 = time.monotonic_ns()
            while flag_view.value != i + 1:
                pass
            t2 = time.monotonic_ns()
            if i >= 20:
                h_call.append(t1 - t0)
                h_rtt.append(t2 - t0)
                h_t0.append(t0)
        self.sync()
        hs = self.dtoh(hstarts, n + 20)[20:].astype(np.int64) + offset
        host = {"api_call": summary_us(h_call), "launch_to_child_start": summary_us((hs - np.array(h_t0)).tolist()),
                "launch_to_done_seen": summary_us(h_rtt),
                "note": "child start uses the calibrated device->host clock offset (+- a few us)"}
        hflag.close()

        counter = self.dev_alloc(8)
        stamps = self.dev_alloc(8 * 1000)
        tail = self.module.device_graph("blink_bench_tail", self.stream, KernelArgs(counter, stamps, 1000))
        check(d.cuGraphLaunch(tail[1], self.stream))
        self.sync()
        st = self.dtoh(stamps, 1000).astype(np.int64)
        tail_res = summary_us(np.diff(st)[10:].tolist())
        return {"device_fire_and_forget": device, "host_launch": host, "device_tail_relaunch": tail_res,
                "ratio_host_over_device_start": round(host["launch_to_child_start"]["median_us"] /
                                                      max(1e-9, device["launch_to_child_start"]["median_us"]), 2),
                "ratio_host_over_device_done": round(host["launch_to_done_seen"]["median_us"] /
                                                     max(1e-9, device["launch_to_done_seen"]["median_us"]), 2)}

    # -- what a step's overhead is made of ----------------------------------------
    def ops(self, reps: int = 1000, runs: int = 5) -> dict:
        """ns per operation of each kind (median of `runs` kernel runs of `reps` each)."""
        dev = self.dev_alloc(4 * 64)
        host = PinnedMapped(4 * 64)
        out = self.dev_alloc(8 * (len(OPS) + 1))
        try:
            self.module.launch("blink_bench_ops", self.stream, KernelArgs(dev, host.device_addr, out, 10), block=256)
            self.sync()
            per = {k: [] for k, _ in OPS}
            for _ in range(runs):
                self.module.launch("blink_bench_ops", self.stream, KernelArgs(dev, host.device_addr, out, reps),
                                   block=256)
                self.sync()
                ns = self.dtoh(out, len(OPS))
                for (k, _), v in zip(OPS, ns):
                    per[k].append(int(v) / reps)
        finally:
            host.close()
        return {"reps": reps, "runs": runs, "ns": {k: round(statistics.median(v), 1) for k, v in per.items()}}

    # -- the echo workload -------------------------------------------------------
    @staticmethod
    def _fill(ring: Ring, n_req: int, prompt_len: int, tokens) -> None:
        """n_req requests of prompt_len random tokens; `tokens`: output tokens of each (an int, or
        one per request: _lengths), request i's output at i x the longest."""
        rng, lengths = np.random.default_rng(0), _lengths(n_req, tokens)
        stride = int(lengths.max())
        for i in range(n_req):
            req = SlotRequest(seq=i + 1, prompt_offset=i * prompt_len, prompt_len=prompt_len,
                              output_offset=i * stride, max_tokens=int(lengths[i]))
            ring.prompt_arena[i * prompt_len:(i + 1) * prompt_len] = rng.integers(0, 49152, prompt_len)
            rec = req.record()
            rec["state"] = SlotState.PREFILL_PENDING
            ring.slots[i] = rec[0]
        fence()   # the requests before the frontend doorbell that announces them
        ring.set("frontend_doorbell", ring.get("frontend_doorbell") + 1)

    def _wait_done(self, ring: Ring, n_req: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not (ring.state[:n_req] == SlotState.DECODE_COMPLETED).all():
            if time.monotonic() > deadline:
                raise RuntimeError("workload did not complete")
            time.sleep(0.0002)

    def _check(self, ring: Ring, n_req: int, prompt_len: int, tokens) -> None:
        """Every request's tokens are the echo of its prompt (the timed loop's plans did no harm)."""
        lengths = _lengths(n_req, tokens)
        stride = int(lengths.max())
        prompts = np.asarray(ring.prompt_arena[:n_req * prompt_len]).reshape(n_req, prompt_len)
        want = prompts[:, np.arange(stride) % prompt_len]
        got = np.asarray(ring.output_arena[:n_req * stride]).reshape(n_req, stride)
        done = np.arange(stride)[None, :] < lengths[:, None]          # each request's own length
        bad = np.flatnonzero(((got != want) & done).any(axis=1))
        assert bad.size == 0, f"requests {bad[:8].tolist()} (of {bad.size}): wrong tokens"

    @staticmethod
    def _setup(batch: int, n_req: int, tokens: int, prompt_len: int, mixed: bool):
        """A workload's ring geometry, scheduler config and tokens (a count, or each request's)."""
        lengths = _lengths(n_req, tokens, mixed)
        geom = RingGeometry(4096, max(1 << 16, n_req * prompt_len), max(1 << 16, n_req * tokens))
        # timed without the first fast plans' checks (the full walks beside them); _check reads every token
        cfg = SchedulerConfig(max_batch_size=batch, max_model_len=prompt_len + tokens + 1, idle_sleep_ns=0,
                              fast_plan_checks=0)
        return geom, cfg, lengths if mixed else tokens

    def workload(self, batch: int, n_req: int, tokens: int, prompt_len: int = 16, mixed: bool = False) -> dict:
        """`mixed`: output lengths drawn from tokens/4..tokens (requests finish at different steps:
        a reap in most steps) instead of all `tokens` (they finish together, batch by batch)."""
        geom, cfg, served = self._setup(batch, n_req, tokens, prompt_len, mixed)
        out = {"batch": batch, "requests": n_req, "prompt_len": prompt_len,
               "tokens_per_request": f"{served.min()}-{tokens}" if mixed else tokens}
        tokens = served

        # persistent scheduler over a host-mapped ring (the one-box deployment); then the same with a
        # slot scan in every iteration (full_scan_us=0: the frontend doorbell unread), the A/B of the bell
        out["persistent"] = self._persistent(geom, cfg, n_req, prompt_len, tokens)
        out["persistent_scan_every_iteration"] = self._persistent(
            geom, dataclasses.replace(cfg, full_scan_us=0), n_req, prompt_len, tokens)
        # and with every step planned by thread 0's walks (fast_plan=False), the A/B of the survey
        out["persistent_full_plan"] = self._persistent(
            geom, dataclasses.replace(cfg, fast_plan=False), n_req, prompt_len, tokens)

        # the same over a ring in device memory (the DPU deployment); a failure costs these columns only
        try:
            out["persistent_device_ring"] = self._device_ring(geom, cfg, n_req, prompt_len, tokens)
        except Exception as e:       # noqa: BLE001 - recorded in the result
            out["persistent_device_ring"] = {"error": f"{type(e).__name__}: {e}"[:300]}

        # host-driven loop: the same C++ loop on a host thread, the same echo graph launched by the host
        # (its state stays where it was: shared memory is the GPU block's, and the twin's copy of it on a
        # host thread would only add the write-backs; the baseline of every earlier run)
        out["host_loop"] = self._host_loop(geom, dataclasses.replace(cfg, shared_state=False), n_req, prompt_len,
                                           tokens)
        out["ratio_makespan_host_over_persistent"] = round(
            out["host_loop"]["makespan_ms"] / out["persistent"]["makespan_ms"], 2)
        return out

    def state_ab(self, batch: int, n_req: int, tokens: int, mixed: bool, prompt_len: int = 16) -> dict:
        """The workload again with the other home of an instance's params, state, counters and
        allocator scalars than the config's (shared_state, BLINK_SCHED_SHARED_STATE): the block's
        shared memory (blink_scheduler_shared, the default) or device memory (blink_scheduler). main
        runs it after every other measurement is written; a failure or a run that does not finish in
        30 s is recorded here, and after one the rest are skipped."""
        if self.state_ab_error is not None:
            return {"error": f"skipped after: {self.state_ab_error}"}
        geom, cfg, served = self._setup(batch, n_req, tokens, prompt_len, mixed)
        try:
            return self._persistent(geom, dataclasses.replace(cfg, shared_state=not cfg.shared_state), n_req,
                                    prompt_len, served, timeout_s=30)
        except Exception as e:       # noqa: BLE001 - recorded in the result
            self.state_ab_error = f"{type(e).__name__}: {e}"[:300]
            return {"error": self.state_ab_error}

    def _persistent(self, geom, cfg, n_req, prompt_len, tokens, timeout_s: float = 120) -> dict:
        mem = PinnedMapped(geom.total_size)
        ring = Ring.create((ctypes.c_char * geom.total_size).from_address(mem.host_addr), geom)
        self._fill(ring, n_req, prompt_len, tokens)
        rt = SchedulerRuntime(self.device, cfg, geom, mem.device_addr, self.module)
        t0 = time.monotonic_ns()
        rt.start()
        try:
            self._wait_done(ring, n_req, timeout_s)
        except Exception as e:
            try:   # abort it: a scheduler left running would share the GPU with the next run
                rt.request_stop(True)
                gone = rt.wait(10)
            except Exception as e2:   # noqa: BLE001 - a faulted context: nothing here runs on it again
                raise RuntimeError(f"{e}; then the abort failed ({type(e2).__name__}: {e2})") from e
            if not gone:
                raise RuntimeError(f"{e}; the scheduler did not exit after an abort") from e
            rt.close()
            mem.close()
            raise
        t1 = time.monotonic_ns()
        rt.request_stop()
        rt.wait(30)
        c = rt.stats().counters
        rt.close()
        self._check(ring, n_req, prompt_len, tokens)
        del ring
        mem.close()
        return {**_persistent_stats(c, t1 - t0), "launch_retries": c["launch_retries"],
                "shared_state": bool(cfg.shared_state)}

    def _device_ring(self, geom, cfg, n_req, prompt_len, tokens) -> dict:
        """The persistent scheduler over the ring in device memory, as the DPU deployment has it (the
        NIC writes it; no slot word crosses PCIe for the kernel): the requests are formatted on the
        host and copied in before the start, as a transport's writes would land; completion is
        polled by copying the slots back every 200 us (the makespan's resolution)."""
        d = self.d
        host = np.zeros(geom.total_size, np.uint8)            # the host's mirror of the ring
        ring = Ring.create(host, geom)
        self._fill(ring, n_req, prompt_len, tokens)
        dring = DeviceRing(geom)
        try:
            check(d.cuMemcpyHtoD(dring.device_addr, host.ctypes.data, host.nbytes), "cuMemcpyHtoD(ring)")
            rt = SchedulerRuntime(self.device, cfg, geom, dring.device_addr, self.module)
            off, nbytes = geom.slots_offset, n_req * (geom.slot_offset(1) - geom.slot_offset(0))
            t0 = time.monotonic_ns()
            rt.start()
            deadline = time.monotonic() + 120
            while True:
                check(d.cuMemcpyDtoH(host.ctypes.data + off, dring.device_addr + off, nbytes), "cuMemcpyDtoH(slots)")
                if (ring.state[:n_req] == SlotState.DECODE_COMPLETED).all():
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("workload did not complete (device ring)")
                time.sleep(0.0002)
            t1 = time.monotonic_ns()
            rt.request_stop()
            rt.wait(30)
            c = rt.stats().counters
            rt.close()
            o_off = geom.output_arena_offset
            check(d.cuMemcpyDtoH(host.ctypes.data + o_off, dring.device_addr + o_off,
                                 n_req * int(_lengths(n_req, tokens).max()) * 4),
                  "cuMemcpyDtoH(outputs)")
            self._check(ring, n_req, prompt_len, tokens)
        finally:
            dring.close()
        return _persistent_stats(c, t1 - t0)

    def _host_loop(self, geom, cfg, n_req, prompt_len, tokens) -> dict:
        from gpu_backend.cuda.twin import TwinScheduler
        d = self.d
        mem = PinnedMapped(geom.total_size)
        ring = Ring.create((ctypes.c_char * geom.total_size).from_address(mem.host_addr), geom)
        self._fill(ring, n_req, prompt_len, tokens)
        bufs = {k: PinnedMapped(-(-n // 8) * 8) for k, n in cfg.buffer_sizes(4096).items()}
        # the echo graph reads the same buffers through their device addresses
        dev_params = cfg.params(geom, mem.device_addr, {k: b.device_addr for k, b in bufs.items()}, 0)
        p_addr = self.dev_alloc(ctypes.sizeof(dev_params))
        check(d.cuMemcpyHtoD(p_addr, ctypes.addressof(dev_params), ctypes.sizeof(dev_params)))
        graph, exe = self.module.device_graph("blink_echo_step", self.stream, KernelArgs(p_addr), block=256)
        self.sync()
        stream, device, current = self.stream, self.device, []

        def launch(ctx, which) -> int:
            if not current:                # the twin's thread needs the context made current once
                device.make_current()
                current.append(True)
            err, = d.cuGraphLaunch(exe, stream)
            return 0 if err == d.CUresult.CUDA_SUCCESS else int(err)

        tw = TwinScheduler(ring, cfg, threads=1, launch_cb=launch, buffers={k: b.host_addr for k, b in bufs.items()},
                           check_plans=False)
        t0 = time.monotonic_ns()
        tw.start()
        self._wait_done(ring, n_req)
        t1 = time.monotonic_ns()
        tw.stop()
        tw.join(30)
        s = tw.stats
        steps = s.steps_prefill + s.steps_decode
        self._check(ring, n_req, prompt_len, tokens)
        res = {"makespan_ms": round((t1 - t0) / 1e6, 3), "steps": steps,
               "us_per_step": round((t1 - t0) / 1e3 / steps, 3),
               "scheduler_overhead_us_per_step": round((s.scan_ns + s.publish_ns + s.commit_ns + s.plan_ns) / 1e3 / steps,
                                                       3),
               **_phases({k: getattr(s, k) for k in ("scan_ns", "publish_ns", "commit_ns", "plan_ns")}, steps),
               "wait_us_per_step": round(s.wait_ns / 1e3 / steps, 3), "shared_state": bool(cfg.shared_state)}
        del ring, tw
        for b in bufs.values():
            b.close()
        mem.close()
        return res


def _lengths(n_req: int, tokens, mixed: bool = False) -> np.ndarray:
    """Output tokens of each request: `tokens` itself if one per request, else all `tokens`, or
    (mixed) drawn from tokens/4..tokens by a fixed seed."""
    if not np.isscalar(tokens):
        return np.asarray(tokens, np.int64)
    if not mixed:
        return np.full(n_req, int(tokens), np.int64)
    return np.random.default_rng(1).integers(max(1, tokens // 4), tokens + 1, n_req)


def _persistent_stats(c, makespan_ns: int) -> dict:
    """A persistent run's figures from its counters and makespan: per step, and by phase."""
    steps = c["steps_prefill"] + c["steps_decode"]
    return {"makespan_ms": round(makespan_ns / 1e6, 3), "steps": steps, "windows": c["windows"],
            "us_per_step": round(makespan_ns / 1e3 / steps, 3),
            "scheduler_overhead_us_per_step": round(
                (c["scan_ns"] + c["publish_ns"] + c.get("commit_ns", 0) + c["plan_ns"]) / 1e3 / steps, 3),
            "scan_us_per_iteration": round(c["scan_ns"] / 1e3 / max(1, c["scans"]), 3),
            "scans_per_step": round(c["scans"] / max(1, steps), 3),
            **_phases(c, steps),
            "launch_call_us_per_step": round(c["launch_ns"] / 1e3 / steps, 3),
            **{f"{k}_us_per_step": round(c.get(f"{k}_ns", 0) / 1e3 / steps, 3)
               for k in ("reap", "policy", "apply", "rows", "pub_keys")},
            "fast_plan_share": round(c.get("fast_plans", 0) / max(1, c["steps_decode"]), 3),
            "fast_admit_share": round(c.get("fast_admits", 0) / max(1, c["steps_prefill"]), 3),
            "fill_blocks": c.get("fill_blocks", 0),
            "par_commits": c.get("par_commits", 0),
            "fill_evictions": c.get("fill_evictions", 0),
            "wait_us_per_step": round(c["wait_ns"] / 1e3 / steps, 3)}


def _phases(c, steps: int) -> dict:
    """The overhead's parts per step: the slot scan, publish, the parallel prefix-cache commits, the
    schedule phase (its launch included)."""
    return {f"{k}_us_per_step": round(c.get(f"{k}_ns", 0) / 1e3 / steps, 3) for k in ("scan", "publish", "commit", "plan")}


def _ab_rows(results: dict, key: str, cells) -> list[str]:
    """One table row per workload that ran the A/B `key`: the batch, then cells(persistent, A/B run)."""
    return [f"| {w['batch']} | {cells(w['persistent'], w[key])} |" for w in results["workloads"] if w.get(key)]


def _in_shared(run: dict) -> bool:
    """Whether a persistent run had its state in shared memory (older results, without the key, did not)."""
    return run.get("shared_state", False)


def write_results(results: dict, out_dir: pathlib.Path, machine: str) -> pathlib.Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{DATE}-{machine}-cuda_scheduler"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    lines = [f"# CUDA persistent scheduler, {machine} ({results['device']})", "",
             "Medians; every comparison is within this one run.", "",
             "| measurement | value |", "|---|---|"]
    sc = results["scan"]
    lines += [f"| scan of {sc['slots']} slots, ring in device memory | {sc['device_memory']['median_us']} us |",
              f"| scan of {sc['slots']} slots, ring host-mapped (PCIe) | {sc['host_mapped']['median_us']} us |"]
    la = results["launch"]
    dev, host = la["device_fire_and_forget"], la["host_launch"]
    lines += [f"| device fire-and-forget: API call | {dev['api_call']['median_us']} us |",
              f"| device fire-and-forget: launch -> child starts | {dev['launch_to_child_start']['median_us']} us |",
              f"| host cuGraphLaunch: launch -> child starts | {host['launch_to_child_start']['median_us']} us |",
              f"| host / device launch-to-start | {la['ratio_host_over_device_start']}x |",
              f"| device launch -> done seen / host launch -> done seen | {dev['launch_to_done_seen']['median_us']} / "
              f"{host['launch_to_done_seen']['median_us']} us ({la['ratio_host_over_device_done']}x) |",
              f"| device tail self-relaunch | {la['device_tail_relaunch']['median_us']} us |"]
    if "ops" in results:
        ns = results["ops"]["ns"]
        lines += ["", "What thread 0 strings together between two steps, one kind at a time, "
                  f"{results['ops']['reps']} in a row (median of {results['ops']['runs']} runs), ns each. Loads "
                  "form a chain (each address from the load before) over 64 words, so the plain ones hit a warm L1; "
                  "in the loop every __threadfence / __threadfence_system also invalidates L1 (CCTL.IVALL in SASS), "
                  "so after publish's fences a plain load costs what the volatile row (L2) says:", "",
                  "| operation | ns |", "|---|---|"]
        lines += [f"| {what} | {ns.get(key, '-')} |" for key, what in OPS]
    first = results["workloads"][0]["persistent"] if results["workloads"] else {}
    home = ("in the block's shared memory (shared_state, blink_scheduler_shared)" if _in_shared(first)
            else "in device memory (blink_scheduler)")
    lines += ["", f"The persistent scheduler as configured by default: its params, state and counters {home}; "
              "the host loop's (the same loop on a host thread) in its own memory, as in every run.", "",
              "| batch | requests x tokens | persistent ms | us/step | overhead us/step | host loop ms | "
              "us/step | host/persistent |", "|---|---|---|---|---|---|---|---|"]
    for w in results["workloads"]:
        p, h = w["persistent"], w["host_loop"]
        lines.append(f"| {w['batch']} | {w['requests']} x {w['tokens_per_request']} | {p['makespan_ms']} | "
                     f"{p['us_per_step']} | {p['scheduler_overhead_us_per_step']} | {h['makespan_ms']} | "
                     f"{h['us_per_step']} | {w['ratio_makespan_host_over_persistent']}x |")
    lines += ["", "Overhead per step by phase, us (slot scan / publish / the parallel prefix-cache commits / schedule "
              "phase, its launch included); `keys`: of the persistent publish, the longest any thread spent on "
              "reading tokens back from the ring for the prefix cache's block keys each step (0 where the key chain "
              "kept up with the tokens: the prompt hashed at intake, each generated token as it is published):", "",
              "| batch | persistent scan | publish | keys | commit | plan | host loop scan | publish | commit | plan |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for w in results["workloads"]:
        p, h = w["persistent"], w["host_loop"]
        lines.append(f"| {w['batch']} | " + " | ".join(str(p.get(f"{k}_us_per_step", "-")) for k in
                                                      ("scan", "publish", "pub_keys", "commit", "plan")) + " | "
                     + " | ".join(str(h.get(f"{k}_us_per_step", "-")) for k in ("scan", "publish", "commit", "plan"))
                     + " |")
    lines += ["", "The persistent schedule phase in parts, us per step (one GPU thread): commit + reap walks / the "
              "policy (prefix lookups included) / applying it (preempt, admit, allocate, chunks) / the graph's key, "
              "lookup and rows / the launch call:", "",
              "| batch | reap | policy | apply | rows | launch | plan (all) |", "|---|---|---|---|---|---|---|"]
    for w in results["workloads"]:
        p = w["persistent"]
        lines.append(f"| {w['batch']} | " + " | ".join(str(p.get(f"{k}_us_per_step", "-")) for k in
                                                      ("reap", "policy", "apply", "rows", "launch_call", "plan")) + " |")
    lines += ["", "The frontend doorbell, A/B in this run: the persistent scheduler scanning the slots only when "
              "the doorbell moved (and every full_scan_us; the default) vs in every iteration (full_scan_us=0). "
              "All requests are written before the start, so after the first scan the bell stays still: the "
              "best case; a frontend submitting all the time rings at most once per iteration.", "",
              "| batch | us/step, bell | scans/step | overhead us/step | us/step, scan every iteration | "
              "overhead us/step | every / bell |", "|---|---|---|---|---|---|---|"]
    lines += _ab_rows(results, "persistent_scan_every_iteration", lambda p, e: (
        f"{p['us_per_step']} | {p.get('scans_per_step', '-')} | {p['scheduler_overhead_us_per_step']} | "
        f"{e['us_per_step']} | {e['scheduler_overhead_us_per_step']} | {round(e['us_per_step'] / p['us_per_step'], 2)}x"))
    lines += ["", "The survey, A/B in this run: steady decode steps and the PREFILL steps that admit into freed seats "
              "planned from the block's parallel survey of the running list and the prefix-cache commits made by every thread (the default) vs by thread 0 "
              "walking the lists (fast_plan=False). The walk's commits count in reap:", "",
              "| batch | decode steps fast-planned | prefill steps admitting from the survey | blocks committed in parallel | blocks taken in parallel (of them "
              "evicted) | commit us/step, survey | plan | reap | policy | apply | commit us/step, walks | plan | reap | "
              "policy | apply | walks / survey (commit + plan) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def parts(x):
        return " | ".join(str(x.get(f"{k}_us_per_step", "-")) for k in ("commit", "plan", "reap", "policy", "apply"))

    def ratio(p, f):
        ours = p.get("plan_us_per_step", 0) + p.get("commit_us_per_step", 0)
        theirs = f.get("plan_us_per_step", 0) + f.get("commit_us_per_step", 0)
        return f"{round(theirs / ours, 2)}x" if ours else "-"
    lines += _ab_rows(results, "persistent_full_plan",
                      lambda p, f: f"{round(100 * p.get('fast_plan_share', 0))}% | "
                                   f"{round(100 * p.get('fast_admit_share', 0))}% | {p.get('par_commits', '-')} | "
                                   f"{p.get('fill_blocks', '-')} ({p.get('fill_evictions', '-')}) | "
                                   f"{parts(p)} | {parts(f)} | {ratio(p, f)}")
    lines += ["", "The loop's state in shared memory, A/B in this run: each instance's params, state, counters and "
              "prefix-cache allocator scalars copied into the block's shared memory and written back before each "
              "launch and at each beat (shared_state, the default) vs in device memory (shared_state=False, "
              "BLINK_SCHED_SHARED_STATE=0):", "",
              "| batch | overhead us/step, shared | publish | plan | reap | policy | apply | rows | "
              "overhead us/step, device memory | publish | plan | reap | policy | apply | rows | "
              "device / shared (overhead) | (makespan) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def thread0(x):
        return " | ".join(str(x.get(k, "-")) for k in ("scheduler_overhead_us_per_step", "publish_us_per_step",
                                                        "plan_us_per_step", "reap_us_per_step", "policy_us_per_step",
                                                        "apply_us_per_step", "rows_us_per_step"))
    for w in results["workloads"]:
        p, ab = w["persistent"], w.get("persistent_state_ab")
        if not ab:
            continue
        if "error" in ab:   # the failed one's 7 columns and the 2 ratios
            cells = [thread0(p), f"failed: {ab['error']} | | | | | |"]
            lines.append(f"| {w['batch']} | {' | '.join(cells if _in_shared(p) else cells[::-1])} | - | - |")
            continue
        sh, dv = (p, ab) if _in_shared(p) else (ab, p)
        r = round(dv["scheduler_overhead_us_per_step"] / max(1e-9, sh["scheduler_overhead_us_per_step"]), 2)
        m = round(dv["makespan_ms"] / max(1e-9, sh["makespan_ms"]), 2)
        lines.append(f"| {w['batch']} | {thread0(sh)} | {thread0(dv)} | {r}x | {m}x |")
    lines += ["", "The persistent scheduler over a ring in device memory (the DPU deployment: the NIC writes the "
              "ring, no slot word crosses PCIe for the kernel; requests copied in before the start):", "",
              "| batch | us/step | overhead us/step | scan | publish | keys | plan | host-mapped overhead us/step |",
              "|---|---|---|---|---|---|---|---|"]
    for w in results["workloads"]:
        dv, p = w.get("persistent_device_ring", {"error": "not run"}), w["persistent"]
        if "error" in dv:
            lines.append(f"| {w['batch']} | failed: {dv['error']} | | | | | | {p['scheduler_overhead_us_per_step']} |")
        else:
            lines.append(f"| {w['batch']} | {dv['us_per_step']} | {dv['scheduler_overhead_us_per_step']} | "
                         f"{dv['scan_us_per_step']} | {dv['publish_us_per_step']} | {dv.get('pub_keys_us_per_step', '-')} | "
                         f"{dv['plan_us_per_step']} | {p['scheduler_overhead_us_per_step']} |")
    lines += ["", "Reproduce: `scripts/gpu_check.sh` (or `python -m bench.cuda_scheduler`).", ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    return stem


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", default="auto", help="result files' label; auto: the card's model (h100, h200)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(pathlib.Path(__file__).parent / "results"))
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and workloads")
    args = ap.parse_args(argv)
    why = driver.unavailable_reason()
    if why is not None:
        print(f"bench.cuda_scheduler: needs a GPU of compute capability >= 9.0 ({why})")
        return 2
    b = Bench()
    args.machine = machine_label(args.machine, b.device.name)
    results = {"date": DATE, "machine": args.machine, "device": b.device.name,
               "sms": b.device.multiprocessors}
    results["scan"] = b.scan(reps=200 if args.quick else 2000)
    print("scan", json.dumps(results["scan"]), flush=True)
    results["launch"] = b.launch(windows=4 if args.quick else 20)
    print("launch", json.dumps(results["launch"]), flush=True)
    results["ops"] = b.ops(reps=200 if args.quick else 1000)
    print("ops", json.dumps(results["ops"]), flush=True)
    # the last: requests of mixed lengths finish at different steps, so most steps reap (the
    # survey's reap against thread 0's walk); in the others they finish together
    shapes = [(1, 8, 256, False), (16, 64, 256, False), (64, 256, 256, False), (256, 1024, 128, False),
              (256, 1024, 224, True)]
    if args.quick:
        shapes = shapes[:2]
    results["workloads"] = []
    for batch, n_req, tokens, mixed in shapes:
        w = b.workload(batch, n_req, tokens, mixed=mixed)
        print("workload", json.dumps(w), flush=True)
        results["workloads"].append(w)
    stem = write_results(results, pathlib.Path(args.out), args.machine)   # before the A/B that may fault
    for w, (batch, n_req, tokens, mixed) in zip(results["workloads"], shapes):
        w["persistent_state_ab"] = b.state_ab(batch, n_req, tokens, mixed)
        print("state_ab", batch, json.dumps(w["persistent_state_ab"]), flush=True)
        stem = write_results(results, pathlib.Path(args.out), args.machine)
    print(stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
