"""`mlxspec serve`: the real `openai` client against a loopback server, exact greedy output.

The reference for every output is plain single-stream decoding (``mlxspec.generate``).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai", reason="the openai client is in the dev extra")

from speculative_helpers import second_request_while_speculating  # noqa: E402

from mlxspec.generate import stream_generate  # noqa: E402
from mlxspec.serving import decode_batch as engine_batch  # noqa: E402
from mlxspec.serving.batch import chat_template_prefix  # noqa: E402
from mlxspec.serving.engine import Engine, Request  # noqa: E402
from mlxspec.serving.http import Server  # noqa: E402
from mlxspec.serving.openai_api import Limits  # noqa: E402
from mlxspec.speculative import make_draft  # noqa: E402

API_KEY = "test-key"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Water boils at"]
# Prompt lookup drafts well on text that repeats the prompt.
EDIT = "Rename x to y: x = 1; print(x); x = x + 1; print(x)\nResult: y = 1; print(y); y ="


def reference(model, tokenizer, prompt, max_tokens):
    """(text, completion tokens) of plain single-stream greedy decoding."""
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=max_tokens))
    tokens = [r.token for r in responses if r.token not in tokenizer.eos_token_ids]
    return "".join(r.text for r in responses), len(tokens)


def record_forwards(model, monkeypatch) -> list[tuple[int, ...]]:
    """The input shapes of the model's forwards from now on (until monkeypatch.undo())."""
    forwards = []
    model_call = type(model).__call__
    monkeypatch.setattr(type(model), "__call__",
                        lambda self, x, *args, **kw: forwards.append(x.shape)
                        or model_call(self, x, *args, **kw))
    return forwards


@pytest.fixture(scope="module")
def server(smollm2):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, max_batch=8, draft=make_draft(model, tokenizer,
                                                                    prompt_lookup=True))
    limits = Limits(max_body_bytes=64 << 10, max_tokens=256, max_context=2048, max_concurrent=3)
    srv = Server(engine, model_id="smollm2", port=0, api_key=API_KEY, limits=limits,
                 allowed_origins=("http://app.example",)).start()
    yield srv
    srv.drain(timeout=5)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _wait_idle(server, seconds=10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.open_requests == 0 and not server.engine_thread.engine.streams:
            return True
        time.sleep(0.02)
    return False


def test_chat_and_streamed_completion_equal_plain_greedy(smollm2, client):
    model, tokenizer = smollm2
    chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    text, n = reference(model, tokenizer, chat_ids, 10)
    r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=10,
                                       temperature=0, logprobs=True, top_logprobs=2)
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == len(chat_ids) and r.usage.completion_tokens == n
    assert r.choices[0].finish_reason == ("length" if n == 10 else "stop")
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == text and len(content) == n
    for c in content:  # greedy: each token is the most likely one
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob)
        assert c.logprob >= c.top_logprobs[1].logprob

    text, n = reference(model, tokenizer, PROMPTS[1], 8)
    chunks = list(client.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=8,
                                            stream=True, stream_options={"include_usage": True},
                                            logprobs=2))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == n and chunks[-2].choices[0].finish_reason
    logprobs = [lp for c in chunks if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]
    assert len(logprobs) == n and all(lp <= 0 for lp in logprobs)
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2"]


def test_concurrent_requests_are_batched_and_exact(smollm2, server, client):
    model, tokenizer = smollm2
    expected = [reference(model, tokenizer, p, 8)[0] for p in PROMPTS[:3]]
    engine = server.engine_thread.engine
    engine.peak_streams = 0

    def ask(prompt):
        return client.completions.create(model="smollm2", prompt=prompt, max_tokens=8).choices[0].text

    with ThreadPoolExecutor(3) as pool:
        texts = list(pool.map(ask, PROMPTS[:3]))
    assert texts == expected
    assert engine.peak_streams >= 2  # they were decoded together


def test_lone_stream_speculates_and_yields_to_the_batch_exactly(smollm2):
    model, tokenizer = smollm2
    prompt_a, prompt_b = tokenizer.encode(EDIT), tokenizer.encode(PROMPTS[0])
    expected_a = reference(model, tokenizer, prompt_a, 32)[0]
    expected_b = reference(model, tokenizer, prompt_b, 4)[0]
    engine = Engine(model, tokenizer, draft=make_draft(model, tokenizer, prompt_lookup=True))
    texts = second_request_while_speculating(engine, Request(prompt_a, max_tokens=32),
                                             Request(prompt_b, max_tokens=4), after=6)
    assert texts == {"first": expected_a, "second": expected_b}


def test_long_prompt_is_prefilled_in_chunks_while_others_decode(smollm2):
    model, tokenizer = smollm2
    long_prompt = tokenizer.encode(" ".join(f"item{i}," for i in range(120)))
    engine = Engine(model, tokenizer, prefill_step=64)
    a = engine.submit(Request(tokenizer.encode(PROMPTS[0]), max_tokens=64))
    while not engine.step():  # A's prompt
        pass
    b = engine.submit(Request(long_prompt, max_tokens=3))
    text_b, steps_before_b = "", 0
    while b in engine.streams:
        events = engine.step()
        if not any(e.rid == b for e in events) and not text_b:
            steps_before_b += 1
            # A keeps decoding during B's prefill (unless it has finished)
            assert any(e.rid == a for e in events) or a not in engine.streams
        text_b += "".join(e.text for e in events if e.rid == b)
    assert steps_before_b >= len(long_prompt) // 64 - 1
    assert text_b == reference(model, tokenizer, long_prompt, 3)[0]


@pytest.mark.parametrize("fused", [True, False], ids=["in-the-step", "own-forward"])
def test_arriving_prompts_cost_one_forward_and_keep_the_output_exact(smollm2, monkeypatch, fused):
    """Prompts arriving together are prefilled together, right-padded, last tokens included,
    and those logits give their first tokens: inside the running stream's decode step
    (``mlxspec.serving.fused_prefill``: its weight products shared) or in one forward of their own; no
    second, per-arrival forward stalls the running stream (mlx-lm's own batching runs one).
    Every stream's tokens equal plain greedy."""
    model, tokenizer = smollm2
    monkeypatch.setattr(engine_batch, "FUSE_PREFILL", fused)
    prompt_a, prompt_b, prompt_c = (tokenizer.encode(p) for p in PROMPTS[:3])
    assert len(prompt_b) != len(prompt_c)
    engine = Engine(model, tokenizer)
    a = engine.submit(Request(prompt_a, max_tokens=12))
    texts = {a: ""}
    for _ in range(3):
        texts[a] += "".join(e.text for e in engine.step())
    forwards = record_forwards(model, monkeypatch)
    b = engine.submit(Request(prompt_b, max_tokens=4))
    c = engine.submit(Request(prompt_c, max_tokens=5))
    texts[b], texts[c], steps, started = "", "", 0, set()
    while started != {a, b, c}:
        steps += 1
        for event in engine.step():
            texts[event.rid] += event.text
            started.add(event.rid)
    monkeypatch.undo()
    assert steps == 2  # prefilled during the first step, their first tokens from the second
    longest = max(len(prompt_b), len(prompt_c))
    # In the step, the first step's forward is the fused one (not the model's own call).
    expected = [(3, 1)] if fused else [(1, 1), (2, longest), (3, 1)]
    assert sorted(forwards) == sorted(expected)
    while engine.streams:
        for event in engine.step():
            texts[event.rid] += event.text
    assert texts == {a: reference(model, tokenizer, prompt_a, 12)[0],
                     b: reference(model, tokenizer, prompt_b, 4)[0],
                     c: reference(model, tokenizer, prompt_c, 5)[0]}


@pytest.mark.parametrize("penalty", [None, 1.3], ids=["greedy", "repetition-penalty"])
def test_a_prompt_cached_whole_joins_in_the_next_step(smollm2, monkeypatch, penalty):
    """A prompt the prefix cache holds whole (a repeated prompt; likewise a stream back from
    speculation) has one token left to feed: it joins the running row in its next batched step
    instead of a forward of its own, and its tokens and log-probabilities are plain decoding's
    (a logits processor sees the whole prompt)."""
    model, tokenizer = smollm2
    prompt_a, prompt_b = (tokenizer.encode(p) for p in PROMPTS[:2])
    engine = Engine(model, tokenizer)
    engine.submit(Request(prompt_a, max_tokens=6))
    while engine.streams:  # A's conversation goes to the prefix cache
        engine.step()
    b = engine.submit(Request(prompt_b, max_tokens=16))
    texts = {b: ""}
    for _ in range(3):
        texts[b] += "".join(e.text for e in engine.step())
    forwards = record_forwards(model, monkeypatch)
    again = engine.submit(Request(prompt_a, max_tokens=6, logprobs=True,
                                  repetition_penalty=penalty))
    texts[again], tokens, steps, first_step, cached = "", [], 0, None, None
    while engine.streams:
        steps += 1
        for event in engine.step():
            texts[event.rid] += event.text
            if event.rid == again:
                first_step, cached = first_step or steps, event.cached_tokens
                tokens.append((event.token, event.logprob))
    monkeypatch.undo()
    assert cached == len(prompt_a) - 1
    # B's step, then two batched steps (A's prompt token, A's first token): no forward of A's own
    assert first_step == 3 and forwards[:3] == [(1, 1), (2, 1), (2, 1)]
    assert all(shape[1] == 1 for shape in forwards)
    plain = list(stream_generate(model, tokenizer, prompt_a, max_tokens=6,
                                 repetition_penalty=penalty))
    assert texts[again] == "".join(r.text for r in plain)
    assert [t for t, _ in tokens if t not in tokenizer.eos_token_ids] == [
        r.token for r in plain if r.token not in tokenizer.eos_token_ids]
    for (token, logprob), r in zip(tokens, plain, strict=False):
        assert logprob == pytest.approx(r.logprobs[token].item(), abs=1e-4)
    assert texts[b] == reference(model, tokenizer, prompt_b, 16)[0]


def test_prefix_cache_holds_only_what_it_counts(smollm2):
    """Memory stays bounded: finished streams' caches in the LRU do not pin the batch's KV."""
    import mlx.core as mx

    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, max_batch=16, prompt_cache_size=4)
    mx.clear_cache()
    baseline = mx.get_active_memory()
    submitted = 0
    while submitted < 16 or engine.streams:
        for _ in range(2 if submitted < 16 else 0):  # arrivals while others decode
            prompt = tokenizer.encode(f"{PROMPTS[submitted % 4]} (request {submitted})")
            engine.submit(Request(prompt, max_tokens=8))
            submitted += 1
        engine.step()
    mx.clear_cache()
    held = mx.get_active_memory() - baseline
    assert 0 < engine.prompt_cache.nbytes <= held <= engine.prompt_cache.nbytes + (4 << 20)


def test_seeded_sampling_is_reproducible(client):
    def ask():
        r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=6,
                                           temperature=1.0, seed=3)
        return r.choices[0].message.content

    assert ask() == ask()


def test_the_chat_template_prefix_is_prefilled_once_for_every_request(smollm2):
    """A fresh server shares its chat template's fixed start: even the first request, with
    nothing cached yet, prefills only what follows it, and answers as plain decoding does."""
    model, tokenizer = smollm2
    prefix = chat_template_prefix(tokenizer)
    assert tokenizer.decode(prefix).startswith("<|im_start|>system\n")
    assert tokenizer.decode(prefix).endswith("<|im_start|>user\n")
    engine = Engine(model, tokenizer, max_batch=2)
    srv = Server(engine, model_id="smollm2", port=0).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=6)
    finally:
        srv.drain(timeout=5)
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert ids[: len(prefix)] == prefix
    assert r.usage.prompt_tokens_details.cached_tokens == len(prefix)
    assert r.choices[0].message.content == reference(model, tokenizer, ids, 6)[0]


def test_prefix_of_an_earlier_request_is_reused(smollm2, client):
    model, tokenizer = smollm2
    first = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=6)
    follow = CHAT + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And of Italy?"}]
    ids = tokenizer.apply_chat_template(follow, add_generation_prompt=True)
    r = client.chat.completions.create(model="smollm2", messages=follow, max_tokens=6)
    assert r.usage.prompt_tokens_details.cached_tokens >= len(
        tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))
    assert r.choices[0].message.content == reference(model, tokenizer, ids, 6)[0]


def _post(server, path, body: bytes, key=API_KEY, headers=None):
    conn = http.client.HTTPConnection(*server.httpd.server_address[:2], timeout=30)
    all_headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    conn.request("POST", path, body=body, headers={**all_headers, **(headers or {})})
    response = conn.getresponse()
    status, data = response.status, response.read()
    conn.close()
    return status, json.loads(data)


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "JSON"),
    (b"[1, 2]", 400, "object"),
    (json.dumps({"messages": []}).encode(), 400, "messages"),
    (json.dumps({"messages": CHAT, "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"messages": CHAT, "max_tokens": 10**6}).encode(), 400, "max_tokens"),
    (json.dumps({"messages": CHAT, "stop": 5}).encode(), 400, "stop"),
    (json.dumps({"messages": [{"role": "user", "content": "hi " * 2100}]}).encode(), 400,
     "context"),
    (b'{"messages": "' + b"x" * (70 << 10) + b'"}', 413, "bytes"),
])
def test_malformed_requests_get_a_json_error(server, body, status, words):
    got, data = _post(server, "/v1/chat/completions", body)
    assert got == status and words in data["error"]["message"]


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "seed": -1},  # a bad seed used to kill the engine thread
    {"prompt": "hi", "seed": 2**70},
    {"prompt": "hi", "logit_bias": {"99999999999999999999": 1}},
    {"prompt": "hi", "logit_bias": {"-3": 1}},
    {"prompt": "\ud800"},  # not valid Unicode: a 400, not a dropped connection
])
def test_bad_values_are_that_request_s_400_and_the_server_goes_on(server, client, body):
    status, data = _post(server, "/v1/completions", json.dumps({**body, "max_tokens": 2}).encode())
    assert status == 400 and data["error"]["message"], data
    assert client.completions.create(model="smollm2", prompt="hi", max_tokens=2).choices


def test_top_k_past_the_vocabulary_keeps_every_token(server, client):
    greedy = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=4)
    wide = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=4,
                                     extra_body={"top_k": 10**6})
    assert wide.choices[0].text == greedy.choices[0].text  # temperature 0: top_k changes nothing


@pytest.mark.parametrize("headers, status", [
    ({"Content-Type": "text/plain"}, 415),  # a cross-site "simple" POST (no CORS preflight)
    ({"Host": "evil.example"}, 403),  # DNS rebinding onto the loopback server
])
def test_cross_site_posts_are_refused(server, headers, status):
    got, data = _post(server, "/v1/chat/completions", json.dumps({"messages": CHAT}).encode(),
                      headers=headers)
    assert got == status and data["error"]["message"]


def test_api_key_is_required_but_health_is_open(server):
    status, data = _post(server, "/v1/chat/completions", json.dumps({"messages": CHAT}).encode(),
                         key="wrong")
    assert status == 401 and data["error"]["type"] == "authentication_error"
    conn = http.client.HTTPConnection(*server.httpd.server_address[:2], timeout=10)
    conn.request("GET", "/health")
    assert json.loads(conn.getresponse().read())["status"] == "ok"


@pytest.mark.parametrize("origin, allowed", [("http://app.example", True),
                                             ("http://evil.example", False)])
def test_only_allowed_web_origins_get_cors_headers(server, origin, allowed):
    conn = http.client.HTTPConnection(*server.httpd.server_address[:2], timeout=10)
    conn.request("OPTIONS", "/v1/chat/completions", headers={"Origin": origin})
    response = conn.getresponse()
    assert response.status == 204
    assert response.getheader("Access-Control-Allow-Origin") == (origin if allowed else None)


def test_disconnecting_clients_free_their_slots_and_the_limit_holds(server, client):
    assert _wait_idle(server)
    body = json.dumps({"prompt": PROMPTS[2], "max_tokens": 256, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    socks = []
    for _ in range(3):  # the limit: three open requests, streaming
        s = socket.create_connection(server.httpd.server_address[:2], timeout=30)
        s.sendall(head + body)
        assert b"200" in s.recv(64)
        socks.append(s)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="smollm2", prompt="hi", max_tokens=2)
    for s in socks:
        s.close()
    assert _wait_idle(server, 5.0)  # the three streams left the engine at once
    r = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_sigterm_drains_open_requests_and_exits(smollm2_dir, tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxspec.cli.main", "serve", "--model", str(smollm2_dir),
         "--port", "0"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()
        assert "http://" in line, line + proc.stderr.read()
        url = line.split()[2].rsplit("/v1", 1)[0]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model="m", prompt=PROMPTS[2], max_tokens=16,
                                           stream=True)
        chunks = [next(iter(stream))]
        proc.send_signal(signal.SIGTERM)  # mid-request: it must still finish
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert proc.wait(timeout=60) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_shutdown_refuses_new_requests(smollm2):
    model, tokenizer = smollm2
    srv = Server(Engine(model, tokenizer), model_id="m", port=0).start()
    srv.draining = True
    status, data = _post(srv, "/v1/completions", json.dumps({"prompt": "hi"}).encode())
    assert status == 503
    srv.close()
    assert not srv.engine_thread.is_alive()
