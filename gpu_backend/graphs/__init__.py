"""The model as captured step graphs: the graph cache of the CUDA executors.

    buckets.py     which graphs exist (prefill rows x length x context, decode rows x
                   context) and the O(1) lookup tables that pick one per step
    plan.py        capture planning: static buffer sizes for the largest shape, capture
                   order, the graph cache's memory estimate
    sampler.py     in-graph sampling: the OpenAI sampling surface (penalties from per-seat
                   counts updated in the graph, logit_bias / allowed ids / bad words,
                   min_tokens, min_p, temperature, top-k, top-p, raw-logit logprobs) with a
                   counter-based per-request RNG: no host sync, no data-dependent shapes
    step.py        the step function every graph captures: static buffers -> paged
                   attention forward -> logits of each row's last token -> tokens
    cpu_graphs.py  the graphs on the CPU: the C++ staging kernels + the step function
                   run eagerly (the scheduler's CPU twin and the CI tests use it)
    capture.py     CUDA capture (torch.cuda.CUDAGraph), node validation, device-launch
                   instantiation and upload (needs a GPU)
    device.py      the model graphs as a StepGraphSource of the persistent scheduler
    hostloop.py    the host-loop runner: the same graphs launched by the host each step
    tensorrt.py    TensorRT as another graph source, where it is installed

Nothing here imports CUDA code at module import time.
"""
