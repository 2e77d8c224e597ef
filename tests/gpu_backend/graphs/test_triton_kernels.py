"""The step graphs' fused Triton kernels (graphs/triton_kernels.py) and the forward made of them
(graphs/fused_forward.py), diffed with the PyTorch operators they replace: each kernel on fresh
random inputs (outputs poisoned first, so an element left unwritten fails), then a whole step of
a random model, "triton" vs "torch", on the same staged buffers and pool.

Without a GPU, Triton's interpreter runs the kernels on the CPU (CI); with one (the tests are then
marked `gpu`, and the plan's `triton` stage selects them), the compiled kernels run on it, and a
step of SmolLM2's shape is also captured into a CUDA graph and replayed."""
from __future__ import annotations

import copy
import json
import os
import pathlib

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"      # before the kernels are decorated (their module's import)
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
triton = pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from gpu_backend.graphs import fused_forward  # noqa: E402
from gpu_backend.graphs import triton_kernels as tk  # noqa: E402
from gpu_backend.model.llama import apply_rope  # noqa: E402

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan"))


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_is_the_residual_add_then_hf_rmsnorm(dtype, tol, with_delta):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 96, generator=gen).to(dtype)
    delta = torch.randn(7, 96, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    want_x = x + delta if with_delta else x.clone()
    x32 = want_x.float()
    want = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    x_dev = x.to(DEVICE)
    got = tk.add_rms_norm(x_dev, delta.to(DEVICE) if with_delta else None, w.to(DEVICE), 1e-5).cpu()
    x = x_dev.cpu()
    # the residual stream updated in place (bf16: the interpreter rounds toward zero, a GPU to nearest)
    torch.testing.assert_close(x, want_x, rtol=0 if dtype == torch.float32 else tol, atol=0 if dtype == torch.float32 else tol)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_silu_mul_is_silu_of_gate_times_up(dtype, tol):
    gu = torch.randn(5, 2 * 1500, generator=torch.Generator().manual_seed(2)).to(dtype)   # two column blocks
    want = F.silu(gu[:, :1500]) * gu[:, 1500:]
    torch.testing.assert_close(tk.silu_mul(gu.to(DEVICE)).cpu(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rope_kv_write_rotates_q_and_writes_k_and_v_at_their_slots(dtype, tol):
    h, kv, d, t, bs, blocks = 9, 3, 64, 6, 16, 5
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, (h + 2 * kv) * d, generator=gen).to(dtype)
    pos = torch.randint(0, 500, (t,), generator=gen)
    slots = torch.randperm(blocks * bs, generator=gen)[:t]
    inv = 1.0 / (100000.0 ** (torch.arange(0, d, 2).float() / d))
    kc = _poisoned(torch.empty(blocks, bs, kv, d, dtype=dtype, device=DEVICE))
    vc = _poisoned(torch.empty(blocks, bs, kv, d, dtype=dtype, device=DEVICE))
    q = tk.rope_kv_write(qkv.to(DEVICE), pos.to(DEVICE), inv.to(DEVICE), slots.to(DEVICE), kc, vc, h, kv).cpu()
    kc, vc = kc.cpu(), vc.cpu()
    freqs = pos.float()[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), -1)
    heads = qkv.float().view(t, h + 2 * kv, d)
    qk = apply_rope(heads[:, :h + kv], emb.cos(), emb.sin())
    torch.testing.assert_close(q.float(), qk[:, :h], rtol=tol, atol=tol)
    torch.testing.assert_close(kc.view(-1, kv, d)[slots].float(), qk[:, h:], rtol=tol, atol=tol)
    assert torch.equal(vc.view(-1, kv, d)[slots], qkv.view(t, h + 2 * kv, d)[:, h + kv:])      # v as it came
    others = torch.ones(blocks * bs, dtype=torch.bool)
    others[slots] = False
    assert kc.view(-1, kv, d)[others].isnan().all()        # no other slot touched


def _attention_reference(q, kc, vc, tables, positions, rows, seq, ctx):
    """Per query: softmax(q k^T / sqrt(D)) v over its row's keys 0..p, in float64."""
    t, h, d = q.shape
    kv = kc.shape[2]
    out = torch.empty(t, h, d, dtype=torch.float64)
    for r in range(rows):
        keys = kc[tables[r]].reshape(ctx, kv, d).double()
        vals = vc[tables[r]].reshape(ctx, kv, d).double()
        for s in range(seq):
            i = r * seq + s
            p = int(positions[i])
            for head in range(h):
                g = head // (h // kv)
                w = torch.softmax(keys[:p + 1, g] @ q[i, head].double() * d ** -0.5, 0)
                out[i, head] = w @ vals[:p + 1, g]
    return out.view(t, h * d)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("rows,seq,ctx", [(5, 1, 160), (2, 23, 64), (1, 40, 96)])
def test_paged_attention_reads_each_rows_blocks_in_place(dtype, tol, rows, seq, ctx):
    """Decode (one query a row, 16 query rows a tile) and prefill (query tiles of 64 over tokens
    x heads, causal within the piece), rows at different positions, blocks scattered."""
    h, kv, d, bs = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(4 + seq)
    blocks = rows * ctx // bs + 3
    kc = torch.randn(blocks, bs, kv, d, generator=gen).to(dtype)
    vc = torch.randn(blocks, bs, kv, d, generator=gen).to(dtype)
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:ctx // bs] for _ in range(rows)])
    first = torch.randint(0, ctx - seq + 1, (rows, 1), generator=gen)
    positions = (first + torch.arange(seq)).reshape(-1)
    q = torch.randn(rows * seq, h, d, generator=gen).to(dtype)
    got = tk.paged_attention(*(t.to(DEVICE) for t in (q, kc, vc, tables, positions)), rows, seq, ctx).cpu()
    want = _attention_reference(q, kc, vc, tables, positions, rows, seq, ctx)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def _decode_inputs(dtype, ctx: int, positions: list[int], seed: int, h=9, kv=3, d=64, bs=16):
    """A decode step's inputs on the CPU: one row a position, each row its own blocks of a random pool
    (shuffled), a random qkv; (qkv, pos, inv_freq, slots, k pool, v pool, tables)."""
    rows = len(positions)
    gen = torch.Generator().manual_seed(seed)
    blocks = rows * ctx // bs + 2
    kc = torch.randn(blocks, bs, kv, d, generator=gen).to(dtype)
    vc = torch.randn(blocks, bs, kv, d, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen)[:rows * ctx // bs].view(rows, ctx // bs)
    pos = torch.tensor(positions)
    slots = tables.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
    qkv = torch.randn(rows, (h + 2 * kv) * d, generator=gen).to(dtype)
    inv = 1.0 / (100000.0 ** (torch.arange(0, d, 2).float() / d))
    return qkv, pos, inv, slots, kc, vc, tables


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_decode_attention_is_rope_kv_write_then_paged_attention(dtype, tol):
    """One token a row, rows at their first position, inside a block, at block edges; each row's own
    blocks. Same output and the same K/V in the pool as the two kernels it fuses."""
    h, kv, ctx = 9, 3, 160
    qkv, pos, inv, slots, kc, vc, tables = _decode_inputs(dtype, ctx, [0, 5, 15, 16, 64, 159], 11)
    rows = len(pos)
    want = None
    if DEVICE == "cpu":                         # under the interpreter: the reference kernels on the CPU
        ref_k, ref_v = kc.clone(), vc.clone()
        q = tk.rope_kv_write(qkv, pos, inv, slots, ref_k, ref_v, h, kv)
        want = tk.paged_attention(q, ref_k, ref_v, tables, pos, rows, 1, ctx)
    kd, vd = kc.to(DEVICE), vc.to(DEVICE)
    got = tk.decode_attention(*(t.to(DEVICE) for t in (qkv, pos, inv, slots)), kd, vd, tables.to(DEVICE), h, ctx).cpu()
    if want is None:                            # on a GPU: the reference kernels there
        kr, vr = kc.to(DEVICE), vc.to(DEVICE)
        qd = tk.rope_kv_write(*(t.to(DEVICE) for t in (qkv, pos, inv, slots)), kr, vr, h, kv)
        want = tk.paged_attention(qd, kr, vr, tables.to(DEVICE), pos.to(DEVICE), rows, 1, ctx).cpu()
        ref_k, ref_v = kr.cpu(), vr.cpu()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(kd.cpu().float(), ref_k.float(), rtol=tol, atol=tol)
    assert torch.equal(vd.cpu(), ref_v)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("splits", [2, 3, 8])
def test_split_decode_attention_is_the_unsplit_kernel(dtype, tol, splits):
    """decode_attention split along the context (flash-decoding: each split's online softmax, then the
    combine kernel) against the unsplit kernel: rows at the first key (every split but the own key's
    empty), inside a split, at a split's edge and at the end of the context; the same K/V stored."""
    h, ctx = 9, 512
    qkv, pos, inv, slots, kc, vc, tables = _decode_inputs(dtype, ctx, [0, 37, 192, 256, 511], 13)
    args = [t.to(DEVICE) for t in (qkv, pos, inv, slots)]
    k1, v1, k2, v2 = (t.to(DEVICE) for t in (kc, vc, kc.clone(), vc.clone()))
    want = tk.decode_attention(*args, k1, v1, tables.to(DEVICE), h, ctx).cpu()
    got = tk.decode_attention(*args, k2, v2, tables.to(DEVICE), h, ctx, splits=splits).cpu()
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(k2.cpu(), k1.cpu()) and torch.equal(v2.cpu(), v1.cpu())


def test_decode_splits_fill_the_multiprocessors_only_where_few_rows_leave_them_idle(monkeypatch):
    """One program a (row, KV head) leaves an H100's 132 SMs idle at 1-8 rows of SmolLM2 (3 KV heads):
    split so the programs about fill them, each split at least 256 keys, at most 32 splits; 64 rows
    (192 programs) or a context of 256 keys do not split."""
    assert tk.decode_splits(1, 3, 1024, 132) == 4         # 1,024 keys: 4 splits of 256
    assert tk.decode_splits(1, 3, 16384, 132) == 32       # 44 would fill the SMs; the cap
    assert tk.decode_splits(8, 3, 4096, 132) == 6         # ceil(132 / 24)
    assert tk.decode_splits(32, 3, 1024, 132) == 2
    assert tk.decode_splits(64, 3, 4096, 132) == 1        # 192 programs already
    assert tk.decode_splits(1, 3, 256, 132) == 1          # one split's worth of keys
    monkeypatch.setenv(tk.SPLIT_ENV, "0")
    assert tk.decode_splits(1, 3, 16384, 132) == 1


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's switch")
def test_the_kernels_refuse_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.setattr(tk, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="CUDA device, or on the CPU under TRITON_INTERPRET=1"):
        tk.silu_mul(torch.zeros(1, 4))


# --- the whole step ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    from gpu_backend.model import LlamaModel, tiny_config
    config = tiny_config(head_dim=16, num_heads=6, num_kv_heads=2, hidden_size=96)
    return config, LlamaModel.random(config, seed=0).eval().fuse_projections().to(DEVICE)


def test_auto_picks_triton_only_on_a_gpu_for_a_supported_model(tiny):
    config, model = tiny
    assert fused_forward.supported(model) is None
    assert fused_forward.resolve("auto", model, torch.device("cpu")) == "torch"
    assert fused_forward.resolve("triton", model, torch.device("cpu")) == "triton"
    from gpu_backend.model import LlamaModel
    unfused = LlamaModel.random(config, seed=0).eval().to(DEVICE)
    assert "not fused" in fused_forward.supported(unfused)
    assert fused_forward.resolve("auto", unfused, torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="do not apply to this model"):
        fused_forward.resolve("triton", unfused, torch.device("cpu"))
    with pytest.raises(ValueError, match="step kernels must be one of"):
        fused_forward.resolve("cutlass", model, torch.device("cpu"))


def test_auto_takes_the_kernels_only_when_they_pass_their_self_test(monkeypatch, caplog, tiny):
    _, model = tiny
    monkeypatch.setattr(fused_forward, "self_test", lambda device, dtype: None)
    assert fused_forward.resolve("auto", model, torch.device("cuda")) == "triton"
    monkeypatch.setattr(fused_forward, "self_test", lambda device, dtype: "paged_attention off by 0.02")
    assert fused_forward.resolve("auto", model, torch.device("cuda")) == "torch"
    assert "Triton kernels are not used (paged_attention off by 0.02)" in caplog.text


def test_the_self_test_passes_here_and_names_a_kernel_that_is_off(monkeypatch):
    dev = torch.device(DEVICE)
    fused_forward._SELF_TESTS.clear()
    assert fused_forward.self_test(dev, torch.float32) is None
    assert fused_forward.self_test(dev, torch.bfloat16) is None
    good = tk.paged_attention
    monkeypatch.setattr(tk, "paged_attention", lambda *a: good(*a) * 1.01)
    fused_forward._SELF_TESTS.clear()
    assert fused_forward.self_test(dev, torch.float32).startswith("paged_attention off by")

    def broken(*a):
        raise RuntimeError("ptxas fatal: something\nand more")
    monkeypatch.setattr(tk, "silu_mul", broken)
    fused_forward._SELF_TESTS.clear()
    assert fused_forward.self_test(dev, torch.float32) == "RuntimeError: ptxas fatal: something"
    fused_forward._SELF_TESTS.clear()


def test_a_split_that_fails_its_check_turns_splitting_off_not_the_kernels(monkeypatch, caplog, tiny):
    """check_splits runs the split decode attention in the model's own variant (its heads, head size,
    dtype, block size) against the unsplit kernel; a disagreement turns splitting off for that
    variant (logged), the Triton kernels stay."""
    _, model = tiny
    dev = torch.device(DEVICE)
    fused_forward._SPLIT_CHECKS.clear()
    assert fused_forward.check_splits(model, dev, 16) is None
    assert fused_forward.decode_splits(1, 1024, model, dev, 16) == 4     # tiny's 2 KV heads: ctx-bound
    good = tk.decode_attention
    monkeypatch.setattr(tk, "decode_attention",
                        lambda *a, splits=1: good(*a, splits=splits) * (1.01 if splits > 1 else 1))
    assert fused_forward.check_splits(model, dev, 16) is None          # checked once a process
    fused_forward._SPLIT_CHECKS.clear()
    assert fused_forward.check_splits(model, dev, 16).startswith("decode_attention split 4 ways off by")
    assert "decode attention is not split along the context (decode_attention split 4 ways off by" in caplog.text
    assert fused_forward.decode_splits(1, 1024, model, dev, 16) == 1
    assert fused_forward.decode_splits(1, 1024, model, dev, 32) == 4     # another block size: its own variant
    fused_forward._SELF_TESTS.clear()
    assert fused_forward.self_test(dev, torch.float32) is None          # the kernels themselves still pass
    fused_forward._SPLIT_CHECKS.clear()


def _both_steps(model, config):
    """[(shape, {kind: (hidden, K pool, V pool, tokens, token logprobs)})]: a decode and a prefill step
    of `model` with PyTorch's operators and with the Triton kernels, from the same staged buffers and pool."""
    from bench import cuda_step_profile as sp
    from gpu_backend.graphs.step import StepFunction
    prof = sp.Profiler(model, config, [(3, 1, 64), (1, 1, 512)], [(2, 32, 48)], DEVICE, kernels="torch")
    assert prof.pool.k.dtype == model.dtype
    steps = {k: StepFunction(model, prof.pool, prof.buffers, prof.plan, kernels=k) for k in ("torch", "triton")}
    b, res = prof.buffers, []
    for g in prof.shapes:
        out = {}
        for kind, step in steps.items():
            prof.pool.k.copy_(torch.randn(prof.pool.k.shape, generator=torch.Generator().manual_seed(5)))
            prof.pool.v.copy_(torch.randn(prof.pool.v.shape, generator=torch.Generator().manual_seed(6)))
            prof.stage(g)
            hidden = step.forward(g)
            pool = (prof.pool.k.clone(), prof.pool.v.clone())
            prof.stage(g)
            b.lp_want[:g.rows].fill_(1)                  # every row's logprob record read (the fused skip the rest)
            step.run(g)
            out[kind] = (hidden, *pool, b.tokens[:g.rows].clone(), b.lp_token[:g.rows].clone())
        res.append((g, out))
    return res


def test_the_cuda_executors_dtype_option():
    from gpu_backend.graphs.config import GraphConfigError, graph_dtype
    assert graph_dtype("auto") == graph_dtype("bfloat16") == torch.bfloat16   # what users get, as vLLM's auto
    assert graph_dtype("float32") == torch.float32
    with pytest.raises(GraphConfigError, match="--dtype must be one of auto, float32, bfloat16"):
        graph_dtype("float16")


def test_a_bfloat16_step_with_the_triton_kernels_is_the_bfloat16_step_with_pytorchs(tiny):
    """The CUDA executors' --dtype bfloat16: weights, activations and the pool in bf16, logits and
    sampling in float32. The two kernel sets round differently, so: hidden states within bf16's
    precision, the pool's K/V too, and the greedy tokens where the top two logits stand apart."""
    config, model = tiny
    model = copy.deepcopy(model).to(torch.bfloat16)
    for g, out in _both_steps(model, config):
        (h0, k0, _, t0, _), (h1, k1, _, t1, _) = out["torch"], out["triton"]
        h0, h1 = h0.float(), h1.float()
        torch.testing.assert_close(h1, h0, rtol=6e-2, atol=6e-2)
        torch.testing.assert_close(k1.float(), k0.float(), rtol=6e-2, atol=6e-2)
        with torch.inference_mode():
            last = h0.view(g.rows, g.len, -1)[:, -1].to(torch.bfloat16)
            logits = model.compute_logits(last)
        top2 = logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.25
        assert (t1 == t0)[clear].all(), (g, t0.tolist(), t1.tolist())


def test_a_bad_kernels_setting_is_one_line(monkeypatch, tiny):
    from gpu_backend.executors import ExecutorOptions
    from gpu_backend.graphs.config import GraphConfigError, GraphExecConfig
    monkeypatch.setenv("BLINK_GRAPH_KERNELS", "cutlass")
    with pytest.raises(GraphConfigError, match="BLINK_GRAPH_KERNELS must be one of auto, triton, torch"):
        GraphExecConfig.from_options(ExecutorOptions(), tiny[0])
    monkeypatch.setenv("BLINK_GRAPH_KERNELS", "torch")
    assert GraphExecConfig.from_options(ExecutorOptions(), tiny[0]).kernels == "torch"
    monkeypatch.delenv("BLINK_GRAPH_KERNELS")
    assert GraphExecConfig.from_options(ExecutorOptions(), tiny[0]).kernels == "auto"


def test_a_step_with_the_triton_kernels_is_the_step_with_pytorchs(tiny):
    """Same staged buffers, same pool: decode and prefill steps give the same hidden states,
    the same K/V in the pool and the same greedy tokens ("torch" is what CI's CPU graphs run)."""
    config, model = tiny
    for g, out in _both_steps(model, config):
        (h0, k0, v0, t0, l0), (h1, k1, v1, t1, l1) = out["torch"], out["triton"]
        torch.testing.assert_close(h1, h0, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(k1, k0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)
        assert t1.tolist() == t0.tolist(), g
        torch.testing.assert_close(l1, l0, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(DEVICE != "cuda", reason="SmolLM2's shape compiled and captured: a GPU")
def test_smollm2_steps_with_the_triton_kernels_capture_and_agree_with_pytorchs():
    """SmolLM2's shape (random float32 weights), decode 64 rows at ctx 256 and a prefill piece: the
    Triton step's hidden states are PyTorch's, its greedy tokens too (near ties aside), and the step
    captured into a CUDA graph replays to the eager step's tokens."""
    from bench import cuda_step_profile as sp
    from gpu_backend.graphs.device import load_graph_model
    from gpu_backend.graphs.step import StepFunction
    config, model = load_graph_model("random:smollm2", torch.float32, "cuda")
    prof = sp.Profiler(model, config, [(64, 1, 256), (1, 1, 1024)], [(4, 128, 256)], "cuda")   # 1x1024: split
    torch_step = StepFunction(model, prof.pool, prof.buffers, prof.plan, kernels="torch")
    assert prof.step.kernels == "triton"                # "auto" took them: the self-test passed on this GPU
    triton_step = StepFunction(model, prof.pool, prof.buffers, prof.plan, kernels="triton")
    b = prof.buffers
    for g in prof.shapes:
        prof.stage(g)
        h0 = torch_step.forward(g).clone()
        with torch.inference_mode():
            logits = model.compute_logits(h0[torch.arange(g.rows, device="cuda") * g.len + g.len - 1])
        prof.stage(g)
        h1 = triton_step.forward(g).clone()
        torch.testing.assert_close(h1, h0, rtol=1e-3, atol=1e-3)
        prof.stage(g)
        triton_step.run(g)
        eager = b.tokens[:g.rows].clone()
        top2 = logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3
        assert (eager == logits.argmax(-1))[clear].all(), g
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            triton_step.run(g)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            triton_step.run(g)
        b.tokens.fill_(-1)
        prof.stage(g)
        graph.replay()
        torch.cuda.synchronize()
        assert b.tokens[:g.rows].tolist() == eager.tolist(), g
        del graph


@pytest.mark.skipif(DEVICE != "cpu", reason="records launches under the interpreter")
def test_the_ahead_of_time_variants_are_the_launches_a_step_makes(tiny, monkeypatch):
    """triton_aot.variants (what the rehearsal compiles for sm_90a) lists exactly the kernels and
    compile-time constants a decode and a prefill step launch."""
    from bench import cuda_step_profile as sp
    from gpu_backend.graphs.step import StepFunction
    from gpu_backend.graphs.triton_aot import variants
    config, model = tiny
    launched = set()

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, num_warps, **consts):
                launched.add((self.kernel.__name__, tuple(sorted(consts.items())), num_warps))
                return self.kernel[grid](*args, num_warps=num_warps, **consts)
            return launch

    from gpu_backend.graphs import triton_sampler as ts
    for name in ("_add_rms_norm_kernel", "_silu_mul_kernel", "_rope_kv_write_kernel", "_paged_attention_kernel",
                 "_decode_attention_kernel", "_decode_split_kernel", "_decode_combine_kernel"):
        monkeypatch.setattr(tk, name, Recorder(getattr(tk, name)))
    for name in ("_process_kernel", "_ban_kernel", "_uniform_kernel", "_update_kernel", "_draw_prep_kernel",
                 "_draw_pick_kernel", "_logprobs_kernel"):
        monkeypatch.setattr(ts, name, Recorder(getattr(ts, name)))
    prof = sp.Profiler(model, config, [(3, 1, 64), (1, 1, 512)], [(2, 32, 48)], DEVICE)   # 1x512: 2 splits
    step = StepFunction(model, prof.pool, prof.buffers, prof.plan, kernels="triton")
    for g in prof.shapes:
        prof.stage(g)
        step.run(g)
    want = {(fn.kernel.__name__, tuple(sorted(consts.items())), warps)
            for label, fn, _, consts, warps in variants(config, torch.float32, sp.BLOCK)
            if label not in ("sampler.process[automaton=False]",    # step graphs always stage an automaton
                             "sampler.uniform")}                     # the draw hashes inline
    assert launched == want


@pytest.mark.skipif(DEVICE != "cpu", reason="the rehearsal's check")
def test_every_variant_compiles_for_sm90_ahead_of_time(tmp_path):
    import json
    import subprocess
    import sys
    from gpu_backend.graphs.device import smollm2_shape_config
    (tmp_path / "config.json").write_text(json.dumps(smollm2_shape_config().to_hf()))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for dtype in ("float32", "bfloat16"):
        r = subprocess.run([sys.executable, "-m", "gpu_backend.graphs.triton_aot", "--model", str(tmp_path),
                            "--dtype", dtype], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        lines = r.stdout.splitlines()
        assert len(lines) == 16 and all(line.startswith("triton_aot: sm_90 ") for line in lines), r.stdout
    r = subprocess.run([sys.executable, "-m", "gpu_backend.graphs.triton_aot"], capture_output=True, text=True,
                       env={**env, "TRITON_INTERPRET": "1"}, timeout=300)
    assert r.returncode == 2 and "unset TRITON_INTERPRET" in r.stderr


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU twin of the persistent scheduler")
def test_the_persistent_twin_serves_the_references_tokens_with_the_triton_kernels(twin_lib, shm_ring):
    """The scheduler's C++ twin, the real staging (padding rows on the sink block and seat, split
    prefill rows, preemption) and the step with the fused kernels (interpreted): greedy_generate's
    tokens, request for request."""
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from test_step_cpu import BS, GEOM, MAX_LEN, serve_twin, workload
    from gpu_backend.model import LlamaModel, greedy_generate, tiny_config
    from gpu_backend.scheduler.policy import blocks_needed
    model = LlamaModel.random(tiny_config(), seed=3).eval()
    fused = LlamaModel.random(tiny_config(), seed=3).eval().fuse_projections()
    work = workload(model.config.vocab_size, 8, seed=4)
    got, tw, graphs = serve_twin(fused, shm_ring(GEOM), blocks_needed(MAX_LEN, BS) + 2, work, kernels="triton")
    assert graphs.step.kernels == "triton"
    assert got == [greedy_generate(model, p, n) for p, n, _ in work]
    assert tw.stats.preempted > 0 and tw.stats.steps_prefill > 0 and tw.stats.steps_decode > 0


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors under the interpreter (the plan runs this file on a GPU)")
def test_auto_serves_decode_steps_on_the_kernels_and_prefill_steps_on_pytorchs(twin_lib, shm_ring, monkeypatch):
    """"auto" where it takes the Triton kernels (a GPU; here the interpreter, by resolve's answer):
    decode steps run the fused forward, prefill steps PyTorch's operators (their graphs replayed
    12-15% faster on the H200), each reading the K/V the other wrote: the scheduler's twin, with
    preemption and split prefill rows, serves greedy_generate's tokens request for request."""
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from test_step_cpu import BS, GEOM, MAX_LEN, serve_twin, workload
    from gpu_backend.model import LlamaModel, greedy_generate, tiny_config
    from gpu_backend.scheduler.policy import blocks_needed
    real_resolve, real_forward, lens = fused_forward.resolve, fused_forward.forward, set()
    monkeypatch.setattr(fused_forward, "resolve", lambda k, m, d: "triton" if k == "auto" else real_resolve(k, m, d))

    def forward(model, input_ids, positions, slot_mapping, tables, k, v, r, s, c):
        lens.add(s)
        return real_forward(model, input_ids, positions, slot_mapping, tables, k, v, r, s, c)
    monkeypatch.setattr(fused_forward, "forward", forward)
    model = LlamaModel.random(tiny_config(), seed=3).eval()
    fused = LlamaModel.random(tiny_config(), seed=3).eval().fuse_projections()
    work = workload(model.config.vocab_size, 8, seed=4)
    got, tw, graphs = serve_twin(fused, shm_ring(GEOM), blocks_needed(MAX_LEN, BS) + 2, work, kernels="auto")
    assert (graphs.step.kernels, graphs.step.prefill_kernels) == ("triton", "torch")
    assert lens == {1}                          # the fused forward ran the decode steps only
    assert got == [greedy_generate(model, p, n) for p, n, _ in work]
    assert tw.stats.preempted > 0 and tw.stats.steps_prefill > 0 and tw.stats.steps_decode > 0


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors under the interpreter (the plan runs this file on a GPU)")
def test_the_profile_sets_autos_prefill_against_the_triton_kernels(tiny, tmp_path, monkeypatch):
    """bench.cuda_step_profile with "auto" where it takes the Triton kernels (here by resolve's answer):
    its served prefill steps are PyTorch's operators, and a prefill shape also gets the Triton kernels'
    replay (`Triton graph ms`, None on a CPU), the A/B behind the choice; decode shapes do not."""
    from bench import cuda_step_profile as sp
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(tiny[0].to_hf()))
    real_resolve = fused_forward.resolve
    monkeypatch.setattr(fused_forward, "resolve", lambda k, m, d: "triton" if k == "auto" else real_resolve(k, m, d))
    assert sp.main(["--device", "cpu", "--model", f"random:{tmp_path / 'model'}", "--kernels", "auto", "--decode", "2x32",
                    "--prefill", "1x16x32", "--runs", "1", "--no-baseline", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / f"{sp.DATE}-cpu-cuda_step_profile.json").read_text())
    assert (res["kernels"], res["prefill_kernels"]) == ("triton", "torch")
    decode, prefill = res["shapes"]
    assert "triton_graph_ms" not in decode and "triton_graph_ms" in prefill
    assert decode["row_group"] == "-" != prefill["row_group"]
