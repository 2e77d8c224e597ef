"""`blink run-batch`: OpenAI batch files (as vLLM's `run-batch` reads and writes them) run
through an OpenAI-compatible server, in an order chosen for throughput (BlendServe, seed 002).

    in.jsonl -> batch_file.read_requests() -> BatchRequest | BadLine per line
    out.jsonl (a rerun) -> batch_file.keep_done() -> custom_ids already answered, skipped
    BatchRequest -> prompts.work_item() -> ordering.Work (prefix key, prompt and output tokens)
    [Work] -> ordering.plan(order=file|blend) -> Plan (submission order, prefix-group leaders)
    Plan -> runner.run_plan(): POST each body to the server with bounded concurrency,
        one output line per request appended and flushed as it finishes, a progress bar
    cli.py: flags; starts `blink serve` on a free port (server.py) or posts to --url

No torch here: this runs wherever the frontend runs.
"""
