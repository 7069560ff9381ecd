"""Many requests at once: the batching engine, the OpenAI-compatible server and batch jobs.

    requests        a request, its events and its stop state
    rows            the running rows of a decode batch (their caches, padding, greedy shortcut)
    decode_batch    one decode step over every running row
    fused_prefill   arriving prompts joined to the running rows' step in one forward
    engine          the scheduler: admission, steps, speculation for a lone stream
    engine_thread   the engine on its own thread, with tickets for the HTTP handlers
    openai_api      the OpenAI wire format, validated in one place
    http            the HTTP server (``mlxspec serve``)
    batch           ``batch_generate``: many prompts through the engine
    batch_jsonl     ``mlxspec batch``: a JSONL file of requests, resumable
"""
