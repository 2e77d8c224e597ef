"""The frontend: OpenAI-compatible HTTP/SSE, tokenizer, slot tracker, token reader,
transports to the ring. Runs on a BlueField's ARM cores or on the host; needs no
torch and no CUDA. Talks to the daemon through the ring only (shared_layout)."""
