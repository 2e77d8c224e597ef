"""The captured model graphs on the GPU, for both CUDA executors (needs a GPU).

    ModelGraphs: a StepGraphSource of the persistent scheduler (cuda/runtime.py):
        prepare(module, params_addr) (at executor start, before READY: the graphs
        read the parameter block, which is filled once the ring exists) ->
        GraphCache.capture; build(rt) -> GraphCache.device_table(); the scheduler
        then looks graphs up and launches them from the device
    CudaLauncher: the host loop's Launcher (hostloop.py) over the same kind of
        GraphCache: the StepBlock in pinned host memory, its device copy, a
        parameter block pointing at that copy (captured against at start, filled
        by bind(ring)); per step: copy the used extents host -> device,
        cuGraphLaunch from the host, copy the sampled tokens back, synchronise;
        `buffers` gives the host loop the sampler seats to fill and the logprob outputs
    load_graph_model(spec, dtype): the model on the GPU (a spec "random:<hf config
        folder or 'smollm2'>" builds random weights of that shape: benchmarks on
        machines the real weights cannot reach)
"""
from __future__ import annotations

import ctypes
import time

import torch

from ..cuda import structs
from ..cuda.driver import bindings, check
from .buckets import BucketTable
from .capture import GraphCache
from .hostloop import StepBlock


class ModelGraphs:
    """The model's step graphs as the persistent scheduler's StepGraphSource."""

    def __init__(self, model, table: BucketTable, num_blocks: int, kernels: str = "auto"):
        self.model, self.table, self.num_blocks, self.kernels = model, table, num_blocks, kernels
        self.max_rows = table.max_rows
        self.cache: GraphCache | None = None
        self.params_addr = 0

    def prepare(self, module, params_addr: int) -> None:
        """Capture every graph against the parameter block at params_addr."""
        self.close()
        self.cache = GraphCache(self.model, self.table, self.num_blocks, module, kernels=self.kernels)
        self.cache.capture(params_addr)
        self.params_addr = params_addr

    def build(self, rt) -> structs.GraphTable:
        if self.cache is None or self.params_addr != rt.params_addr:
            self.prepare(rt.module, rt.params_addr)
        return self.cache.device_table()

    def report(self) -> dict:
        return self.cache.report() if self.cache is not None else {}

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache = None


class CudaLauncher:
    """Host-launched steps over a GraphCache captured for this launcher's parameter block."""

    def __init__(self, cache: GraphCache | None, echo_module, block: StepBlock, device_block_addr: int, stream):
        """cache None: the stand-in echo graph (one blink_echo_step node) instead of the model.
        Captures the graphs against this launcher's parameter block; bind() fills it."""
        d = bindings()
        self.cache, self.block, self.stream = cache, block, stream
        self.buffers = cache.buffers if cache is not None else None    # seats and logprob outputs
        self.dev = device_block_addr
        self.params_addr = int(check(d.cuMemAlloc(ctypes.sizeof(structs.SchedParams)),
                                     "cuMemAlloc(host-loop params)"))
        self._echo = None
        if cache is None:
            from ..cuda.runtime import KernelArgs
            self._echo_args = KernelArgs(self.params_addr)
            self._echo = echo_module.device_graph("blink_echo_step", stream, self._echo_args, block=256)
        else:
            cache.capture(self.params_addr)
        self._tokens_off = block.layout["step_tokens"]
        self.launch_ns = self.wait_ns = 0   # cumulative: copies and launch calls; the wait for the step

    def bind(self, ring, ring_device_addr: int) -> None:
        """The ring the graphs' staging reads token ids from (as the device addresses it)."""
        self.params = self.block.params(self.dev, ring_device_addr, ring)
        check(bindings().cuMemcpyHtoD(self.params_addr, ctypes.addressof(self.params), ctypes.sizeof(self.params)),
              "cuMemcpyHtoD(host-loop params)")

    def launch(self, graph: int, n_chunks: int) -> None:
        d, b = bindings(), self.block
        t0 = time.perf_counter_ns()
        for off, n in b.extents(n_chunks):
            if n:
                check(d.cuMemcpyHtoDAsync(self.dev + off, b.addr + off, n, self.stream), "cuMemcpyHtoDAsync(step)")
        exe = self._echo[1] if self._echo is not None else self.cache.exec_handle(graph, 0)
        check(d.cuGraphLaunch(exe, self.stream), "cuGraphLaunch(step)")
        check(d.cuMemcpyDtoHAsync(b.addr + self._tokens_off, self.dev + self._tokens_off, 4 * max(1, n_chunks),
                                  self.stream), "cuMemcpyDtoHAsync(tokens)")
        t1 = time.perf_counter_ns()
        check(d.cuStreamSynchronize(self.stream), "cuStreamSynchronize(step)")   # the host waits for every step
        self.launch_ns += t1 - t0
        self.wait_ns += time.perf_counter_ns() - t1

    def close(self) -> None:
        d = bindings()
        if self._echo is not None:
            check(d.cuGraphExecDestroy(self._echo[1]), "cuGraphExecDestroy")
            check(d.cuGraphDestroy(self._echo[0]), "cuGraphDestroy")
            self._echo = None
        if self.params_addr:
            check(d.cuMemFree(self.params_addr), "cuMemFree(host-loop params)")
            self.params_addr = 0


def smollm2_shape_config(tied: bool = True):
    """SmolLM2-135M-Instruct's shape (the embedded default's), for random-weight benchmarks.
    `tied=False` gives the head its own weights: with random tied embeddings the model only
    repeats its last token (a token's own embedding dominates its logits), which tells
    nothing about agreement; the head's matmul costs the same either way."""
    from ..model.config import ModelConfig
    return ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                       num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                       max_position_embeddings=8192, tie_word_embeddings=tied, attention_bias=False, qk_norm=False,
                       bos_token_id=1, eos_token_ids=(2,))


def load_graph_model(spec: str, dtype: torch.dtype, device: str = "cuda", fuse: bool = True):
    """(ModelConfig, LlamaModel on `device`, its q/k/v and gate/up projections fused: 4 matmuls a
    layer instead of 7, and RoPE over q and k at once, fewer kernels in every step graph).
    "random:smollm2" (SmolLM2's shape, untied head) or "random:<folder with config.json>": random
    weights of that shape (LlamaModel.random, seed 0), for machines the real weights cannot reach.
    fuse=False: the model as loaded, with the explicit RMSNorm operations (the A/B of
    bench.cuda_step_profile)."""
    from ..model.llama import LlamaModel
    if spec.startswith("random:"):
        what = spec.removeprefix("random:")
        if what == "smollm2":
            config = smollm2_shape_config(tied=False)
        else:
            import json
            import pathlib
            from ..model.config import ModelConfig
            config = ModelConfig.from_hf(json.loads((pathlib.Path(what) / "config.json").read_text()))
        model = LlamaModel.random(config, seed=0).to(device=device, dtype=dtype).eval()
    else:
        from ..model.loader import load_model
        loaded = load_model(spec, dtype=dtype, device=device)
        config, model = loaded.config, loaded.model
    if fuse:
        return config, model.fuse_projections()
    from ..model.llama import RMSNorm
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.fused_kernel = False
    return config, model
