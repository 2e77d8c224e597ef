"""The real SmolLM2-135M through `blink gpu-daemon` (CPU executor) as a process."""
from __future__ import annotations

import pathlib
import sys
import time

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from frontend_player import FrontendPlayer  # noqa: E402
from test_daemon_process import start_daemon, stop, wait_ready  # noqa: E402

from shared_layout import FinishReason  # noqa: E402


@pytest.mark.slow
def test_smollm2_greedy_through_the_daemon_equals_reference(ring_name):
    from tokenizers import Tokenizer

    from gpu_backend.model import greedy_generate
    from gpu_backend.model.loader import load_model, prepare_default_model

    folder = prepare_default_model()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    chats = ["What is the capital of France?", "Name three colors.", "Count from one to five."]
    prompts = [tok.encode(f"<|im_start|>user\n{c}<|im_end|>\n<|im_start|>assistant\n").ids for c in chats]
    proc = start_daemon(ring_name, "--model", "default", "--kv-cache-mb", "64", "--max-batch-size", "4",
                         "--threads", "1",   # one intra-op thread: the CI box is shared
                         "--dtype", "float32")   # the reference below computes in float32
    # start_daemon passes --model null first; the later --model wins in argparse
    try:
        ring = wait_ready(ring_name, proc, timeout_s=120)
        assert ring.get("model_vocab_size") == 49152
        fe = FrontendPlayer(ring)
        slots = [fe.submit(p, 12) for p in prompts]
        last_beat, max_gap_s = ring.get("backend_heartbeat_ns"), 0.0

        def watch_heartbeat():     # the beat goes on while the model computes
            nonlocal last_beat, max_gap_s
            now = ring.get("backend_heartbeat_ns")
            if now != last_beat:
                max_gap_s = max(max_gap_s, (now - last_beat) / 1e9)
                last_beat = now
            time.sleep(0.001)
        results = [fe.wait(s, timeout_s=120, pump=watch_heartbeat) for s in slots]
        assert max_gap_s < 5.0   # nominally 0.05 s; loose because the CI box is shared
        assert stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    model = load_model("default").model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        wants = [greedy_generate(model, p, 12, eos_ids=(2,)) for p in prompts]
    finally:
        torch.set_num_threads(threads)
    for want, r in zip(wants, results):
        assert r.tokens == want
        assert r.finish == (FinishReason.STOP if want[-1] == 2 else FinishReason.LENGTH)
    assert "Paris" in tok.decode(results[0].tokens)
