"""PagedAttention against plain causal attention per sequence, over scattered blocks."""
import random

import pytest
import torch

from gpu_backend.kv_pool import KVCacheConfig, KVPool
from gpu_backend.model.attention import causal_attention
from gpu_backend.paged_attention import PagedAttention, PagedBatch

H, KV, D, BS = 6, 2, 8, 4


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_mixed_batch_matches_per_sequence_causal_attention():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(KVCacheConfig(num_blocks=64, block_size=BS, num_layers=2, num_kv_heads=KV, head_dim=D))
    attn = PagedAttention(pool)
    free = list(range(64))
    rng.shuffle(free)                      # block tables are scattered, not contiguous
    # per sequence: full history of q/k/v, tokens already cached, block table
    lens = [1, 3, 9, 17, 4, 30]
    seqs = []
    for n in lens:
        q = torch.randn(n + 5, H, D, generator=gen)
        k = torch.randn(n + 5, KV, D, generator=gen)
        v = torch.randn(n + 5, KV, D, generator=gen)
        table = [free.pop() for _ in range((n + 5 + BS - 1) // BS)]
        seqs.append(dict(q=q, k=k, v=v, table=table, done=0))
    # step 1: prefill each prefix except the last token (chunks), step 2: a mixed batch of
    # single-token decodes and multi-token chunks continuing from cached context
    plans = [[(i, n - 1 if n > 1 else 1) for i, n in enumerate(lens)],
             [(0, 1), (1, 1), (2, 1), (3, 3), (4, 4), (5, 6)]]
    for layer in (0, 1):
        for s in seqs:
            s["done"] = 0
        for plan in plans:
            plan = sorted(plan, key=lambda x: x[1] != 1)
            chunks, q, k, v = [], [], [], []
            for i, n in plan:
                s = seqs[i]
                a = s["done"]
                chunks.append((a, n, s["table"]))
                q.append(s["q"][a:a + n]), k.append(s["k"][a:a + n]), v.append(s["v"][a:a + n])
            attn.batch = PagedBatch.build(chunks, BS)
            out = attn(layer, torch.cat(q), torch.cat(k), torch.cat(v))
            row = 0
            for i, n in plan:
                s = seqs[i]
                a = s["done"]
                want = causal_attention(s["q"][a:a + n], s["k"][:a + n], s["v"][:a + n])
                torch.testing.assert_close(out[row:row + n], want, atol=1e-5, rtol=1e-5)
                row += n
                s["done"] += n


def test_single_token_chunks_must_lead():
    with pytest.raises(ValueError):
        PagedBatch.build([(0, 3, [0]), (5, 1, [1, 2])], BS)
