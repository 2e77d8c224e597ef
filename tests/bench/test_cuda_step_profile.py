"""bench.cuda_step_profile on the CPU (the code a lent GPU runs in the plan's `graphs` call): the
shapes parse, a step of each is staged as a real one at full context, the parts and the profile
come back, and the result files are the ones the plan declares."""
from __future__ import annotations

import fnmatch
import json
import pathlib
import sys

import pytest
import torch

from bench import cuda_step_profile as sp
from gpu_backend.model import LlamaModel, tiny_config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))
import gpu_plan as plan  # noqa: E402

CONFIG = tiny_config()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(CONFIG.to_hf()))
    return folder


def test_shapes_parse_and_bad_ones_say_why():
    assert sp.parse_shapes("1x256, 8x250", "decode") == [(1, 1, 256), (8, 1, 256)]   # ctx in whole blocks
    assert sp.parse_shapes("16x128x512", "prefill") == [(16, 128, 512)]
    assert sp.parse_shapes("", "prefill") == []
    for text, kind in (("1x", "decode"), ("0x64", "decode"), ("2x32", "prefill"), ("1x64x32", "prefill")):
        with pytest.raises(SystemExit, match="bench.cuda_step_profile: "):
            sp.parse_shapes(text, kind)


def test_quick_caps_the_shapes_a_stage_names_for_the_cpus_dry_run():
    """The rehearsal runs a dry_cpu stage's own argv with --quick: its shapes shrink to the CPU's size
    (the bf16 profile's 128x256 outran its 60 s budget on an AVX2-only CPU), its --profile with them."""
    assert sp.quick_shapes("1x256,64x256,128x256") == "1x128,4x128"
    assert sp.quick_shapes("16x128x512, 1x64x32") == "4x128x128,1x64x32"
    assert sp.quick_shapes("") == "" and sp.quick_shapes("1x") == "1x"          # parse_shapes refuses it
    for stage in (s for c in plan.CALLS for s in c.stages if s.dry_cpu):
        argv = [str(a) for a in stage.argv[stage.argv.index("-m") + 2:]]
        decode = argv[argv.index("--decode") + 1] if "--decode" in argv else sp.QUICK_DECODE
        for rows, _, ctx in sp.parse_shapes(sp.quick_shapes(decode), "decode"):
            assert rows <= sp.QUICK_ROWS and ctx <= sp.QUICK_CTX, (stage.name, decode)
        if "--profile" in argv:
            want = sp.quick_shapes(argv[argv.index("--profile") + 1])
            assert want in [f"{r}x{c}" for r, _, c in sp.parse_shapes(sp.quick_shapes(decode), "decode")]


def test_a_staged_step_is_a_real_step_at_full_context():
    model = LlamaModel.random(CONFIG, seed=0).eval()
    prof = sp.Profiler(model, CONFIG, [(3, 1, 64)], [(2, 16, 48)], "cpu")
    decode, prefill = prof.shapes
    b = prof.buffers
    prof.stage(decode)
    per = decode.ctx // sp.BLOCK
    tables = b.block_tables[:3 * per].view(3, per)
    assert len(set(tables.flatten().tolist())) == 3 * per           # every row its own blocks
    assert b.positions[:3].tolist() == [63] * 3                      # the last position of the context
    slots = b.slot_mapping[:3]
    assert (slots // sp.BLOCK).tolist() == tables[:, -1].tolist() and (slots % sp.BLOCK).tolist() == [15] * 3
    prof.step.run(decode)
    assert ((b.tokens[:3] >= 0) & (b.tokens[:3] < CONFIG.vocab_size)).all()
    prof.stage(prefill)
    assert b.positions[:16].tolist() == list(range(32, 48)) and b.q_lens[:2].tolist() == [16, 16]
    # greedy on the sink seat: the step's tokens are the argmax of the logits of each row's last token
    with torch.inference_mode():
        from gpu_backend.graphs.step import GraphAttention
        attn = GraphAttention(prof.pool, b, prefill, prof.plan.row_group(prefill))
        hidden = model(b.input_ids[:32], b.positions[:32], attn)
        want = model.compute_logits(hidden[[15, 31]]).argmax(-1)
    prof.step.run(prefill)
    assert b.tokens[:2].tolist() == want.tolist()


def test_the_cpu_run_writes_the_files_the_plan_declares(tiny_folder, tmp_path, capsys):
    rc = sp.main(["--device", "cpu", "--quick", "--model", f"random:{tiny_folder}", "--out", str(tmp_path),
                  "--decode", "1x32,3x64", "--prefill", "2x16x32"])
    assert rc == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"{sp.DATE}-cpu-cuda_step_profile.json", f"{sp.DATE}-cpu-cuda_step_profile.md"]
    stage = next(s for c in plan.CALLS for s in c.stages if s.name == "step_profile")
    assert stage.dry_cpu and all(any(fnmatch.fnmatch(f, d) for d in stage.outputs) for f in files)
    res = json.loads((tmp_path / files[0]).read_text())
    assert [r["shape"] for r in res["shapes"]] == ["decode[1x1, ctx 32]", "decode[3x1, ctx 64]",
                                                    "prefill[2x16, ctx 32]"]
    for r in res["shapes"]:
        assert r["graph_ms"] is None                                 # no CUDA graph on a CPU
        assert all(r[k] > 0 for k in ("forward_ms", "logits_ms", "sample_ms", "step_ms"))
    p = res["profile"]
    assert p["shape"] == "decode[3x1, ctx 64]" and p["clock"] == "cpu" and p["kernels_per_step"] is None
    names = [t["name"] for t in p["top"]]
    assert len(names) == sp.TOP and any(n in ("aten::mm", "aten::addmm", "aten::bmm") for n in names)
    md = (tmp_path / files[1]).read_text()
    assert "| decode[3x1, ctx 64] | - |" in md and "Profile of decode[3x1, ctx 64]" in md


def test_a_failing_profiler_costs_its_table_not_the_run(tiny_folder, tmp_path, monkeypatch, capsys):
    def broken(self, g, steps=3):
        raise RuntimeError("CUPTI unavailable")
    monkeypatch.setattr(sp.Profiler, "profile", broken)
    assert sp.main(["--device", "cpu", "--quick", "--model", f"random:{tiny_folder}", "--out", str(tmp_path),
                    "--decode", "1x32", "--prefill", ""]) == 0
    res = json.loads((tmp_path / f"{sp.DATE}-cpu-cuda_step_profile.json").read_text())
    assert res["profile"] == {"shape": "decode[1x1, ctx 32]", "error": "RuntimeError: CUPTI unavailable"}
    assert len(res["shapes"]) == 1 and res["shapes"][0]["step_ms"] > 0
    assert "Profile of decode[1x1, ctx 32] failed: RuntimeError: CUPTI unavailable" in \
        (tmp_path / f"{sp.DATE}-cpu-cuda_step_profile.md").read_text()


def test_the_served_step_and_its_baseline_give_the_same_tokens_and_logits(tiny_folder):
    """The A/B's two sides compute the same step: projections fused, F.rms_norm and the attention
    by scaled_dot_product_attention (one mask a step) vs unfused, explicit norm operations and
    matmul / mask / softmax / matmul. Same weights (the loader's seed), same staged buffers."""
    from gpu_backend.graphs.device import load_graph_model
    from gpu_backend.graphs.step import GraphAttention
    from gpu_backend.model.llama import RMSNorm
    config, served = load_graph_model(f"random:{tiny_folder}", torch.float32, "cpu")
    base = load_graph_model(f"random:{tiny_folder}", torch.float32, "cpu", fuse=False)[1]
    assert served.layers[0].self_attn.qkv_proj is not None and base.layers[0].self_attn.qkv_proj is None
    assert all(not m.fused_kernel for m in base.modules() if isinstance(m, RMSNorm))
    prof = sp.Profiler(served, config, [(3, 1, 64)], [(2, 16, 48)], "cpu", base)
    b = prof.buffers
    for g in prof.shapes:
        prof.stage(g)
        prof.base_step.run(g)
        want = b.tokens[:g.rows].clone()
        prof.stage(g)
        prof.step.run(g)
        assert b.tokens[:g.rows].tolist() == want.tolist(), g
        with torch.inference_mode():
            n = g.rows * g.len
            hidden = [m(b.input_ids[:n], b.positions[:n], GraphAttention(prof.pool, b, g, g.rows, impl))
                      for m, impl in ((served, "sdpa"), (base, "explicit"))]
        torch.testing.assert_close(hidden[0], hidden[1], rtol=1e-4, atol=1e-4)


def test_the_triton_step_is_profiled_beside_the_same_model_on_pytorchs_operators(tiny_folder, tmp_path):
    """--kernels triton (what "auto" picks on a GPU), here under Triton's interpreter in a child: the
    report names the kernels and carries the PyTorch-operator column of the A/B."""
    import os
    import subprocess
    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, "-m", "bench.cuda_step_profile", "--device", "cpu", "--quick", "--model",
                        f"random:{tiny_folder}", "--kernels", "triton", "--decode", "2x32", "--prefill", "",
                        "--runs", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=pathlib.Path(sp.__file__).parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / f"{sp.DATE}-cpu-cuda_step_profile.json").read_text())
    assert res["kernels"] == "triton" and res["shapes"][0]["row_group"] == "-"
    assert "torch_graph_ms" in res["shapes"][0] and res["torch_profile"]["shape"] == "decode[2x1, ctx 32]"
    md = (tmp_path / f"{sp.DATE}-cpu-cuda_step_profile.md").read_text()
    assert "step kernels triton" in md and "| PyTorch ops graph ms |" in md and "on PyTorch's operators" in md
