"""The RDMA verbs layer both sides of the ring speak (DESIGN §4, verbs transport).

    bootstrap.py  the one-time TCP exchange of QP and ring-region data (wire format, pure)
    plan.py       ring writes/reads -> RDMA work requests (pure, no pyverbs)
    progress.py   work requests in flight and what their completions mean (pure)
    device.py     the thin pyverbs layer: ports, memory regions, RC queue pairs

dpu_frontend/transport/verbs.py (the frontend's Transport) and
gpu_backend/rdma_server.py (the daemon's side) both import from here, so the
daemon never imports the frontend. Importing this package loads no pyverbs.
"""
