"""The daemon: one-time setup, model loading, paged KV cache and the executors
(CPU reference, CUDA persistent, CUDA host-loop baseline). Serves the ring;
never serves HTTP or tokenizes."""
