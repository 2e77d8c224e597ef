"""kv_pool: pool sizing and tensor shapes."""
from gpu_backend.kv_pool import KVCacheConfig, KVPool, blocks_for_budget


def test_pool_sizing_from_budget():
    # SmolLM2: 30 layers x 3 kv heads x 64 dims, fp32, block 16: 2*30*16*3*64*4 = 737280 B per block
    assert blocks_for_budget(1024 * 1024 * 1024, 30, 3, 64, 16, 4) == 1456
    pool = KVPool(KVCacheConfig(num_blocks=5, block_size=4, num_layers=2, num_kv_heads=2, head_dim=8))
    assert tuple(pool.k.shape) == (2, 2, 5, 4, 8) and pool.nbytes == 2 * 2 * 5 * 4 * 2 * 8 * 4
