"""Serving benchmark: mlxspec serve vs mlx_lm.server side by side, mlxspec batch, a load test.

    python bench/serve.py [--model DIR] [--clients 1,2,4,8,16] [--seconds 20] [--max-tokens 64]
                          [--batch-prompts 256] [--load-clients 64] [--load-seconds 60]
                          [--skip ceiling,serving,speculation,batch,shortcut,load,structured]
                          [--only structured] [--structured-rounds 2]
                          [--out result.json]

Sections (JSON on stdout, one object):
- ``ceiling``: mlx-lm's batched decode step alone at each batch size (no arrivals, no HTTP):
  the most batching can give on this machine.
- ``serving``: ``mlxspec serve`` and ``mlx_lm.server`` (subprocesses on loopback, both with
  mlxspec's BLAS set-up) taking turns at each concurrency, each client sending requests back to
  back: the aggregate tokens/s inside a steady window (``--warmup`` s after the start, for
  ``--seconds``), p50/p99 time to first token and p50/p99 inter-token latency (per request:
  (last token time - first token time) / (tokens - 1)); medians over the rounds, each round
  running every concurrency (the scaling: the median of each round's own N-clients / 1-client).
- ``speculation``: one client, an editing prompt, ``mlxspec serve`` plain vs ``--prompt-lookup``.
- ``batch``: ``mlxspec.batch_generate`` on N prompts vs the same prompts one by one
  (``mlxspec.generate``; a subset, as a rate), as plain text and as chat messages (the chat
  template's shared prefix prefilled once).
- ``shortcut``: ``mlxspec.batch_generate`` with the batch's greedy shortcut on and off in turns
  (``mlxspec.serving.rows.GREEDY_SHORTCUT``), same prompts and batch size, same texts required.
- ``load``: many clients for a bounded time against ``mlxspec serve``: mixed streaming and
  non-streaming, some disconnecting early, some malformed; checks that every answer to the same
  greedy prompt is the same text (no mixed-up responses), that the server survives, and samples
  its resident memory.
- ``structured``: one stream in the serving engine answering held-out questions under a JSON
  schema against free text, plain and with prompt lookup: decode tokens/s, the grammar mask's
  cost per token, and the share of answers that parse and validate (``jsonschema``).
The machine's load average is recorded beside the numbers.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

PROMPTS = [
    "Explain why the sky is blue.", "Write a haiku about the sea.",
    "List three uses of a paperclip.", "What is the capital of Japan?",
    "Describe a cat in one paragraph.", "How do vaccines work?",
    "Give me a short recipe for pancakes.", "What is 17 times 23?",
    "Summarize the plot of Romeo and Juliet.", "Why do leaves change color?",
    "Tell me a fun fact about octopuses.", "How does a bicycle stay upright?",
    "Write a limerick about a robot.", "What causes earthquakes?",
    "Name five programming languages.", "What is photosynthesis?",
]
EDIT_PROMPT = (
    "Rewrite the function with the variable `count` renamed to `total`. Output only code.\n\n"
    "def tally(items):\n    count = 0\n    for item in items:\n        if item.ok:\n"
    "            count += item.weight\n        else:\n            count -= 1\n"
    "    print('count is', count)\n    return count\n"
)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(int(q * len(values)), len(values) - 1)], 4)


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- servers -------------------------------------------------------------------------------------


def start_server(kind: str, model: str, port: int, extra: list[str]) -> subprocess.Popen:
    if kind == "mlx_lm":  # same back-end as mlxspec: BLAS set-up, fused ops, JIT flags, CPU ops
        code = ("import sys, mlxspec; from mlxspec import cpu; "
                "cpu.before_load(); cpu.prepare(None); "
                "from mlx_lm.server import main; "
                "sys.argv = ['mlx_lm.server'] + sys.argv[1:]; main()")
        cmd = [sys.executable, "-c", code, "--model", model, "--port", str(port),
               "--log-level", "WARNING", *extra]
    else:
        cmd = [sys.executable, "-m", "mlxspec.cli.main", "serve", "--model", model, "--port",
               str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{kind} server did not start")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (Linux), None where /proc is missing."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_idle(proc: subprocess.Popen, timeout: float = 60.0) -> float:
    """Wait until a server stops computing (under 5 % of a core over half a second): a server
    still decoding for clients that went away would slow the next run, whichever server it is.
    Returns the seconds waited."""
    tic = time.perf_counter()
    last = cpu_seconds(proc.pid)
    while last is not None and time.perf_counter() - tic < timeout:
        time.sleep(0.5)
        now = cpu_seconds(proc.pid)
        if now is None or now - last < 0.025:
            break
        last = now
    return round(time.perf_counter() - tic, 2)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


# -- one request ----------------------------------------------------------------------------------


def stream_request(port: int, body: dict, stop_after: int | None = None,
                   deadline: float | None = None) -> dict:
    """POST a streaming chat completion; times the chunks (``times``: seconds since the request,
    ``clock``: ``time.perf_counter()`` values). ``stop_after``: disconnect after that many chunks;
    ``deadline``: disconnect at that ``perf_counter()`` time (``cut`` is then True)."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.connect()
    sock = conn.sock  # kept: the response takes it over (HTTP/1.0)
    tic = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    result = {"status": response.status, "text": "", "times": [], "clock": [], "tokens": 0}
    if response.status != 200:
        response.read()
        conn.close()
        return result
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if chunk.get("usage"):
            result["tokens"] = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                now = time.perf_counter()
                result["times"].append(now - tic)
                result["clock"].append(now)
                result["text"] += content
        if deadline is not None and time.perf_counter() >= deadline:
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            result["cut"] = True
            break
        if stop_after is not None and len(result["times"]) >= stop_after:
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            result["disconnected"] = True
            break
    conn.close()
    return result


def plain_request(port: int, body: dict | bytes) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    data = body if isinstance(body, bytes) else json.dumps(body)
    conn.request("POST", "/v1/chat/completions", data, {"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    try:
        parsed = json.loads(payload)
    except json.JSONDecodeError:
        parsed = {}
    return {"status": response.status, "body": parsed}


def chat_body(prompt: str, max_tokens: int) -> dict:
    return {"model": "default_model", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0}


# -- sections -------------------------------------------------------------------------------------


def concurrency_run(port: int, clients: int, requests: int, max_tokens: int,
                    prompts: list[str]) -> dict:
    results: list[dict] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(requests):
            prompt = prompts[(c * requests + r) % len(prompts)]
            try:
                out = stream_request(port, chat_body(prompt, max_tokens))
            except (OSError, http.client.HTTPException) as e:
                out = _connection_failed(e)
            with lock:
                results.append(out)

    tic = time.perf_counter()
    _run_clients(clients, client)
    wall = time.perf_counter() - tic
    ok = [r for r in results if r["status"] == 200 and r["times"]]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["times"][0] for r in ok]
    itl = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    return {"clients": clients, "requests": len(results), "failed": len(results) - len(ok),
            "tokens": tokens, "seconds": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2), **_latencies(ttft, itl),
            "loadavg": loadavg()}


def _connection_failed(error: Exception) -> dict:
    """A request's result when the connection was refused or dropped."""
    return {"status": type(error).__name__, "text": "", "times": [], "clock": [], "tokens": 0}


def _run_clients(clients: int, client) -> None:
    """``client(c)`` for c in range(clients), each in its own thread, all at once."""
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _latencies(ttft: list[float], itl: list[float]) -> dict:
    return {"ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "itl_p50": percentile(itl, 0.5), "itl_p99": percentile(itl, 0.99)}


def steady_run(port: int, clients: int, seconds: float, warmup: float, max_tokens: int,
               prompts: list[str]) -> dict:
    """Throughput at a steady ``clients`` concurrency: every client sends requests back to back
    until the window ends; the content chunks (one per token, both servers) that arrive inside
    the window ``[warmup, warmup + seconds)`` are counted, so neither the start nor the drain
    of a fixed set of requests (clients finishing at different times) enters the rate. TTFT and
    ITL come from the requests that finished inside the window."""
    results: list[dict] = []
    lock = threading.Lock()
    start = time.perf_counter()
    window = (start + warmup, start + warmup + seconds)

    def client(c: int) -> None:
        r = 0
        while time.perf_counter() < window[1]:
            prompt = prompts[(c * 7 + r) % len(prompts)]
            r += 1
            try:
                out = stream_request(port, chat_body(prompt, max_tokens), deadline=window[1])
            except (OSError, http.client.HTTPException) as e:
                out = _connection_failed(e)
            with lock:
                results.append(out)

    _run_clients(clients, client)
    chunks = sum(window[0] <= t < window[1] for r in results for t in r["clock"])
    done = [r for r in results if r["status"] == 200 and r["times"] and not r.get("cut")
            and r["clock"][-1] >= window[0]]
    ttft = [r["times"][0] for r in done]
    itl = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1)
           for r in done if len(r["times"]) > 1]
    return {"clients": clients, "requests": len(results),
            "failed": sum(r["status"] != 200 for r in results),
            "tokens": chunks, "seconds": seconds, "tokens_per_s": round(chunks / seconds, 2),
            **_latencies(ttft, itl), "loadavg": loadavg()}


def serving(args) -> dict:
    """Both servers up at once (an idle one costs nothing); each of the ``--rounds`` rounds runs
    every concurrency once, the servers taking turns (in alternating order) at each, and the
    medians over the rounds are reported. On a shared machine the speed drifts by tens of percent
    within minutes: measured this way, the numbers compared (one server against the other, N
    clients against one) always come from neighbouring windows, and the scaling is the median of
    each round's own ratio (``mlxspec_scaling_vs_1_client``, per round in ``..._rounds``).
    After each run the next waits until the server that ran is idle (``settle_s``): one that
    keeps decoding for the clients cut off at the window's end would slow the other's run."""
    kinds = ("mlxspec", "mlx_lm")
    ports = {kind: free_port() for kind in kinds}
    procs = {}
    runs = {(kind, clients): [] for kind in kinds for clients in args.clients}
    try:
        for kind in kinds:
            procs[kind] = start_server(kind, args.model, ports[kind], [])
            stream_request(ports[kind], chat_body("Hi", 4))  # warm-up
        for r in range(args.rounds):
            for clients in args.clients:
                for kind in kinds if r % 2 == 0 else kinds[::-1]:
                    run = steady_run(ports[kind], clients, args.seconds, args.warmup,
                                     args.max_tokens, PROMPTS)
                    run["settle_s"] = wait_idle(procs[kind])  # its cut-off requests drained
                    runs[kind, clients].append(run)
    finally:
        for proc in procs.values():
            stop_server(proc)
    out = {kind: [_median_run(runs[kind, c]) for c in args.clients] for kind in kinds}
    for a, b in zip(out["mlxspec"], out["mlx_lm"], strict=True):
        a["vs_mlx_lm"] = round(a["tokens_per_s"] / max(b["tokens_per_s"], 1e-9), 3)
    base = args.clients[0]
    per_round = {str(c): [round(x["tokens_per_s"] / max(y["tokens_per_s"], 1e-9), 2)
                          for x, y in zip(runs["mlxspec", c], runs["mlxspec", base], strict=True)]
                 for c in args.clients}
    out[f"mlxspec_scaling_vs_{base}_client_rounds"] = per_round
    out[f"mlxspec_scaling_vs_{base}_client"] = {
        c: round(statistics.median(v), 2) for c, v in per_round.items()}
    return out


def _median_run(runs: list[dict]) -> dict:
    """The median of each number over the rounds (counts summed), load averages and the seconds
    the server took to go idle after each round listed."""
    out = {"clients": runs[0]["clients"], "rounds": len(runs),
           "requests": sum(r["requests"] for r in runs), "failed": sum(r["failed"] for r in runs),
           "loadavg": [r["loadavg"] for r in runs],
           "settle_s": [r.get("settle_s") for r in runs]}
    for key in ("tokens_per_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = round(statistics.median(values), 4) if values else None
    return out


def speculation(args) -> dict:
    out = {}
    for name, extra in (("plain", []), ("prompt_lookup", ["--prompt-lookup"])):
        port = free_port()
        proc = start_server("mlxspec", args.model, port, extra)
        try:
            stream_request(port, chat_body("Hi", 4))
            out[name] = concurrency_run(port, 1, args.requests, args.max_tokens * 2,
                                        [EDIT_PROMPT])
        finally:
            stop_server(proc)
    out["speedup"] = round(out["prompt_lookup"]["tokens_per_s"]
                           / max(out["plain"]["tokens_per_s"], 1e-9), 3)
    return out


def ceiling(args) -> dict:
    """What batching can give on this machine at most: mlx-lm's batched decode step alone (its
    ``BatchGenerator``, the same prompts, no request arriving or leaving, no HTTP), tokens/s at
    each batch size and the ratio to batch size 1; a server's throughput at N clients stays
    below the ratio at N by what arrivals (prefill) and departures cost."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    import mlxspec

    model, tokenizer = mlxspec.load(args.model)
    rows = []
    # batch 1 first (a warm-up) and last as well: the ratios use its faster run
    for size in [1, *args.clients, 1]:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % 16]}],
                                                 add_generation_prompt=True) for i in range(size)]
        generator = BatchGenerator(model, stop_tokens=[], completion_batch_size=max(size, 8),
                                   prefill_step_size=512)
        generator.insert(prompts, [args.max_tokens + 8] * size)
        for _ in range(4):  # prefill and the first steps
            generator.next()
        tic, tokens = time.perf_counter(), 0
        for _ in range(args.max_tokens):
            tokens += len(generator.next()[1])
        rate = tokens / (time.perf_counter() - tic)
        generator.close()
        mx.clear_cache()
        rows.append({"batch": size, "tokens_per_s": round(rate, 2)})
    single = max(r["tokens_per_s"] for r in rows if r["batch"] == 1)
    rows = rows[1:-1]
    for row in rows:
        row["vs_batch_1"] = round(row["tokens_per_s"] / single, 2)
    return {"steps": args.max_tokens, "batch_1_tokens_per_s": single, "rows": rows,
            "loadavg": loadavg()}


def batch(args) -> dict:
    """Both kinds of job: the prompts as plain text (nothing shared but a BOS token) and as chat
    messages through the model's chat template, as ``mlxspec batch`` runs ``messages`` lines
    (the template and system prompt shared: ``Engine.share_prefix`` prefills them once)."""
    import mlxspec

    model, tokenizer = mlxspec.load(args.model)
    texts = [f"{PROMPTS[i % len(PROMPTS)]} (variant {i})" for i in range(args.batch_prompts)]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                           add_generation_prompt=True) for t in texts]
    return {"text": _batch_job(args, model, tokenizer, texts),
            "chat": _batch_job(args, model, tokenizer, chats)}


def _batch_job(args, model, tokenizer, prompts: list) -> dict:
    import mlxspec
    from mlxspec.generate import encode_prompt, stream_generate
    from mlxspec.serving.batch import choose_batch_size, shared_prefix

    tokens = [encode_prompt(tokenizer, p).tolist() for p in prompts]
    tic = time.perf_counter()
    longest = max(len(t) for t in tokens) + args.max_tokens
    size, sizing = choose_batch_size(model, tokens_per_sequence=longest, num_prompts=len(prompts))
    sizing_s = time.perf_counter() - tic
    results = mlxspec.batch_generate(model, tokenizer, prompts, max_tokens=args.max_tokens,
                                     batch_size=size)
    batched_s = time.perf_counter() - tic  # the sizing included
    batched_tokens = sum(r.completion_tokens for r in results)
    subset = prompts[: args.one_by_one]
    tic, single_tokens = time.perf_counter(), 0
    for p in subset:
        *_, last = stream_generate(model, tokenizer, p, max_tokens=args.max_tokens)
        single_tokens += last.generation_tokens
    single_s = time.perf_counter() - tic
    batched_rate, single_rate = batched_tokens / batched_s, single_tokens / single_s
    return {"prompts": len(prompts), "prompt_tokens": sum(map(len, tokens)),
            "shared_prefix_tokens": len(shared_prefix(tokens)), "batched_tokens": batched_tokens,
            "batched_seconds": round(batched_s, 2), "batched_tokens_per_s": round(batched_rate, 2),
            "one_by_one_prompts": len(subset), "one_by_one_tokens_per_s": round(single_rate, 2),
            "speedup": round(batched_rate / single_rate, 2), "batch_size": size,
            "sizing_seconds": round(sizing_s, 2), "sizing": sizing, "loadavg": loadavg()}


# Held out from the tests and from the grammar's development: questions and the schemas that
# constrain their answers (bounded strings and arrays, so an answer fits in the token budget).
STRUCTURED = [
    ("Describe a fruit as JSON: its name, colour and whether it is sweet.",
     {"type": "object", "additionalProperties": False, "required": ["name", "colour", "sweet"],
      "properties": {"name": {"type": "string", "maxLength": 20},
                     "colour": {"enum": ["red", "green", "yellow", "orange", "purple"]},
                     "sweet": {"type": "boolean"}}}),
    ("Give the population of Paris in millions and the year, as JSON.",
     {"type": "object", "additionalProperties": False, "required": ["millions", "year"],
      "properties": {"millions": {"type": "number", "minimum": 0, "maximum": 100},
                     "year": {"type": "integer", "minimum": 1900, "maximum": 2030}}}),
    ("List up to three programming languages and their creators, as JSON.",
     {"type": "object", "additionalProperties": False, "required": ["languages"],
      "properties": {"languages": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
          "type": "object", "additionalProperties": False, "required": ["name", "creator"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "creator": {"type": "string", "maxLength": 30}}}}}}),
    ("Book a table: a date (YYYY-MM-DD), a party size and an optional note, as JSON.",
     {"type": "object", "additionalProperties": False, "required": ["date", "size", "note"],
      "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                     "size": {"type": "integer", "minimum": 1, "maximum": 12},
                     "note": {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]}}}),
    ("Classify the sentence 'I love this phone' as JSON with a label and a score.",
     {"type": "object", "additionalProperties": False, "required": ["label", "score"],
      "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                     "score": {"type": "number", "minimum": 0, "maximum": 1}}}),
    ("Give a person as JSON: name, age, and an address with street and city.",
     {"type": "object", "additionalProperties": False, "required": ["name", "age", "address"],
      "properties": {"name": {"type": "string", "maxLength": 30},
                     "age": {"type": "integer", "minimum": 0, "maximum": 130},
                     "address": {"type": "object", "additionalProperties": False,
                                 "required": ["street", "city"],
                                 "properties": {"street": {"type": "string", "maxLength": 40},
                                                "city": {"type": "string", "maxLength": 30}}}}}),
]


def _engine_answer(engine, request) -> dict:
    """One request alone through the engine: its text, tokens, decode seconds (first token to
    last) and its grammar's mask statistics."""
    rid = engine.submit(request)
    grammar = [p for p in engine.streams[rid].processors if hasattr(p, "stats")]
    text, times, reason = "", [], None
    while reason is None:
        for event in engine.step():
            text, reason = text + event.text, event.finish_reason
            times.append(time.perf_counter())
    masks, mask_s = grammar[0].stats if grammar else (0, 0.0)
    return {"text": text, "tokens": len(times), "seconds": times[-1] - times[0],
            "reason": reason, "masks": masks, "mask_seconds": mask_s}


def structured(args) -> dict:
    """Constrained decoding in the serving engine (``mlxspec.serving.engine``, as ``serve`` runs a
    lone request): decode tokens/s answering under a JSON schema against free text, without and
    with speculation (prompt lookup), the grammar mask's cost per token, and how many of the
    schema-constrained answers parse and validate (``jsonschema``) on the held-out schemas."""
    import jsonschema

    import mlxspec
    from mlxspec.grammar import json_schema_grammar
    from mlxspec.serving.engine import Engine, Request
    from mlxspec.speculative import make_draft

    model, tokenizer = mlxspec.load(args.model)
    cases = [(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                            add_generation_prompt=True),
              schema, json_schema_grammar(schema)) for q, schema in STRUCTURED]
    engines = {"plain": Engine(model, tokenizer, max_batch=1, prompt_cache_size=0),
               "prompt_lookup": Engine(model, tokenizer, max_batch=1, prompt_cache_size=0,
                                       draft=make_draft(model, tokenizer, prompt_lookup=True))}
    _engine_answer(engines["plain"], Request(cases[0][0], max_tokens=16))  # warm-up
    totals: dict[tuple[str, str], list[float]] = {}
    answers = []
    for _ in range(args.structured_rounds):
        for drafter, engine in engines.items():
            for prompt, schema, grammar in cases:  # both modes of a question in turns
                budget = args.max_tokens * 2
                for mode in ("json_schema", "free_text"):
                    out = _engine_answer(engine, Request(
                        prompt, max_tokens=budget,
                        grammar=grammar if mode == "json_schema" else None))
                    # free text as long as the JSON answer: the same contexts, the same steps
                    budget = out["tokens"]
                    t = totals.setdefault((drafter, mode), [0, 0.0, 0, 0.0])
                    t[0] += out["tokens"] - 1
                    t[1] += out["seconds"]
                    t[2] += out["masks"]
                    t[3] += out["mask_seconds"]
                    if mode == "json_schema":
                        answers.append((out, schema))
    rows = []
    for (drafter, mode), (tokens, seconds, masks, mask_s) in totals.items():
        rows.append({"drafter": drafter, "mode": mode, "decode_tokens": tokens,
                     "decode_tokens_per_s": round(tokens / seconds, 2),
                     "masks_per_token": round(masks / tokens, 2) if masks else None,
                     "mask_us_per_token": round(1e6 * mask_s / tokens, 1) if masks else None,
                     "mask_us_per_mask": round(1e6 * mask_s / masks, 1) if masks else None})
    rate = {(r["drafter"], r["mode"]): r["decode_tokens_per_s"] for r in rows}
    cost = {d: round(1 - rate[(d, "json_schema")] / rate[(d, "free_text")], 3) for d in engines}
    valid = 0
    for out, schema in answers:
        try:
            jsonschema.validate(json.loads(out["text"]), schema)
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    return {"what": "decode tokens/s (first token to last) of one engine stream; the free-text "
                    "answer of each question is cut to the length of its JSON answer",
            "schemas": len(cases), "rounds": args.structured_rounds, "rows": rows,
            "schema_cost_of_decode_speed": cost, "answers": len(answers), "valid_answers": valid,
            "finished_answers": sum(out["reason"] == "stop" for out, _ in answers),
            "grammar_library": "llguidance", "loadavg": loadavg()}


def shortcut(args) -> dict:
    """``mlxspec.batch_generate`` with the batch's greedy shortcut on and off, in turns, at a
    fixed batch size (``mlxspec.serving.rows.GREEDY_SHORTCUT``); the texts must be the same."""
    import mlxspec
    import mlxspec.serving.rows as engine_rows

    model, tokenizer = mlxspec.load(args.model)
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} (variant {i})" for i in range(args.shortcut_prompts)]
    rates: dict[str, list[float]] = {"on": [], "off": []}
    texts: dict[str, list[str]] = {}
    try:
        for _ in range(args.rounds):
            for variant in ("on", "off"):
                engine_rows.GREEDY_SHORTCUT = variant == "on"
                tic = time.perf_counter()
                results = mlxspec.batch_generate(model, tokenizer, prompts,
                                                 max_tokens=args.max_tokens,
                                                 batch_size=len(prompts))
                seconds = time.perf_counter() - tic
                rates[variant].append(round(sum(r.completion_tokens for r in results) / seconds, 2))
                texts[variant] = [r.text for r in results]
    finally:
        engine_rows.GREEDY_SHORTCUT = True
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    return {"prompts": len(prompts), "batch_size": len(prompts), "tokens_per_s": rates,
            "speedup": round(on / off, 3), "same_texts": texts["on"] == texts["off"],
            "loadavg": loadavg()}


def load_test(args) -> dict:
    port = free_port()
    proc = start_server("mlxspec", args.model, port,
                        ["--max-concurrent", str(2 * args.load_clients)])  # 429 = lost
    stop_at = time.monotonic() + args.load_seconds
    counts = {"stream_ok": 0, "plain_ok": 0, "disconnected": 0, "malformed_400": 0,
              "rejected_429": 0, "unexpected": 0}
    texts: dict[str, set[str]] = {}
    unexpected: dict[str, int] = {}
    lock = threading.Lock()
    memory: list[float] = []

    def client(c: int) -> None:
        rng = random.Random(c)
        while time.monotonic() < stop_at:
            prompt = PROMPTS[rng.randrange(8)]
            action = rng.random()
            try:
                if action < 0.4:
                    r = stream_request(port, chat_body(prompt, 24))
                    key, text = ("stream_ok", r["text"]) if r["status"] == 200 else (None, None)
                elif action < 0.75:
                    r = plain_request(port, chat_body(prompt, 24))
                    text = r["body"].get("choices", [{}])[0].get("message", {}).get("content")
                    key = "plain_ok" if r["status"] == 200 else None
                elif action < 0.9:
                    r = stream_request(port, chat_body(prompt, 200), stop_after=2)
                    key, text = "disconnected", None
                else:
                    r = plain_request(port, b'{"messages": [oops')
                    key, text = ("malformed_400" if r["status"] == 400 else None), None
                if key is None:
                    key = "rejected_429" if r["status"] == 429 else f"status {r['status']}"
            except (OSError, http.client.HTTPException) as e:
                key, text = type(e).__name__, None
            with lock:
                if key not in counts:
                    counts["unexpected"] += 1
                    unexpected[key] = unexpected.get(key, 0) + 1
                    continue
                counts[key] += 1
                if text is not None:
                    texts.setdefault(prompt, set()).add(text)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.load_clients)]
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            memory.append(rss_mb(proc.pid) or 0.0)
            time.sleep(1)
        alive = proc.poll() is None
        health = plain_status(port)
    finally:
        stop_server(proc)
    return {"clients": args.load_clients, "seconds": args.load_seconds, **counts,
            "unexpected_kinds": unexpected,
            "prompts_with_differing_answers": sum(len(v) > 1 for v in texts.values()),
            "server_alive": alive, "health_after": health,
            "rss_mb_start": memory[0] if memory else None,
            "rss_mb_max": max(memory) if memory else None,
            "rss_mb_end": memory[-1] if memory else None,
            "rss_mb_every_10s": [round(m) for m in memory[::10]], "loadavg": loadavg()}


def plain_status(port: int) -> int | None:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    parser.add_argument("--clients", default="1,2,4,8,16")
    parser.add_argument("--requests", type=int, default=4,
                        help="requests of the speculation section's client")
    parser.add_argument("--seconds", type=float, default=20,
                        help="serving: the measured window of each round")
    parser.add_argument("--warmup", type=float, default=4,
                        help="serving: seconds of load before the window opens")
    parser.add_argument("--rounds", type=int, default=3, help="turns per server per concurrency")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-prompts", type=int, default=256)
    parser.add_argument("--one-by-one", type=int, default=16, help="prompts run one by one")
    parser.add_argument("--shortcut-prompts", type=int, default=64,
                        help="prompts (and batch size) of the shortcut section")
    parser.add_argument("--load-clients", type=int, default=64)
    parser.add_argument("--load-seconds", type=float, default=60)
    parser.add_argument("--structured-rounds", type=int, default=2,
                        help="structured: turns over the schemas per drafter and mode")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip")
    parser.add_argument("--only", default=None, help="run only these sections (comma-separated)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    if args.model is None:
        import mlxspec  # noqa: F401
        from mlxspec.load import resolve_model_path

        args.model = str(resolve_model_path(None))
    skip = set(args.skip.split(",")) - {""}
    if args.only:  # e.g. --only structured
        skip = {"ceiling", "serving", "speculation", "batch", "shortcut", "load",
                "structured"} - set(args.only.split(","))
    from mlxspec.cpu import cpu_model

    result = {"model": args.model, "max_tokens": args.max_tokens, "loadavg_start": loadavg(),
              "cpu_count": os.cpu_count(), "cpu": cpu_model()}
    sections = {"ceiling": ceiling, "serving": serving, "speculation": speculation,
                "batch": batch, "shortcut": shortcut, "load": load_test, "structured": structured}
    for name, run in sections.items():
        if name not in skip:
            result[name] = run(args)
            print(json.dumps({name: result[name]}), file=sys.stderr, flush=True)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
