"""The ring contract shared by the frontend and the GPU daemon (DESIGN §3).

layout.py (bytes) + states.py (lifecycle) -> ring.py (accessors for both sides),
shm.py (the ring as a shared-memory file), arena.py (token ranges the frontend
hands out), cheader.py (the same layout for C/CUDA), timers.py (how both polling
sides sleep). Code both sides run beyond the ring itself lives here too, so the two
sides meet only in this package: errors.py (a ring that cannot be reached), rdma/
(the verbs layer), gguf_tokenizer.py (the tokenizer a GGUF carries). Imports nothing
from the other packages.
"""
from .layout import (HEADER, LAYOUT_VERSION, MAGIC, MAX_STOP_IDS, SLOT, SLOT_DTYPE, LayoutMismatch,
                     RingGeometry)
from .ring import (BackendPort, FrontendPort, Ring, SlotRequest, doorbell_write, fence, now_ns, request_error,
                   submit_writes)
from .states import (BackendStatus, ErrorCode, FinishReason, IllegalTransition, Side, SlotState,
                     check_transition)

__all__ = [
    "HEADER", "LAYOUT_VERSION", "MAGIC", "MAX_STOP_IDS", "SLOT", "SLOT_DTYPE", "LayoutMismatch", "RingGeometry",
    "BackendPort", "FrontendPort", "Ring", "SlotRequest", "doorbell_write", "fence", "now_ns", "request_error", "submit_writes",
    "BackendStatus", "ErrorCode", "FinishReason", "IllegalTransition", "Side", "SlotState", "check_transition",
]
