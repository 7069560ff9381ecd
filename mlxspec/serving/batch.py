"""Offline batch generation: many prompts through one continuously batched ``Engine``.

``batch_generate`` is the Python API (results in input order); ``mlxspec.serving.batch_jsonl`` runs the
JSONL job behind ``mlxspec batch`` on ``iter_batch``. ``choose_batch_size`` sizes the batch from
the memory each sequence needs and a measured throughput curve.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlxspec.benchmark import model_bytes
from mlxspec.chat_template import chat_prompt
from mlxspec.generate import encode_prompt
from mlxspec.serving.engine import Engine, Request
from mlxspec.speculative import make_draft

CURVE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # batch sizes the throughput curve is measured at
KNEE = 0.9  # doubling the batch must raise the throughput by 1 / KNEE (11 %) to be worth it
MEMORY_FRACTION = 0.6  # of the available memory, for weights + KV caches
CURVE_SECONDS = 10.0  # time the throughput curve may take; larger sizes go unmeasured after it
MIN_SHARED_PREFIX = 16  # tokens every prompt starts with: prefilled once for the whole job


@dataclass
class BatchResult:
    """One prompt's outcome: ``text`` and counts, or ``error`` (then ``text`` is empty)."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


# -- sizing the batch ----------------------------------------------------------------------------


def available_memory() -> int:
    """Bytes the process may use: Metal's recommended working set, else MemAvailable (Linux)."""
    if mx.metal.is_available():
        return int(mx.device_info()["max_recommended_working_set_size"])  # not mx.metal.: deprecated
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def kv_bytes_per_token(model: nn.Module) -> int:
    """KV cache bytes one token of one sequence costs (from the caches of a one-token forward;
    mlx-lm allocates them in steps, so the bytes are divided by the allocated length)."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    total = 0.0
    for c in cache:
        keys, values = c.state[:2]
        total += (keys.nbytes + values.nbytes) / keys.shape[-2]
    return max(int(total), 1)


def decode_throughput(model: nn.Module, batch: int, context: int, steps: int = 3) -> float:
    """Tokens per second of batched one-token decode steps over ``context`` cached tokens."""
    cache = make_prompt_cache(model)
    y = mx.zeros((batch, 1), mx.int32)
    if context > 1:
        model(mx.zeros((batch, context - 1), mx.int32), cache=cache)
        mx.eval([c.state for c in cache])
    mx.eval(model(y, cache=cache))  # the last cached token, at the decode shape: the warm-up
    tic = time.perf_counter()
    for _ in range(steps):
        mx.eval(model(y, cache=cache))
    return batch * steps / (time.perf_counter() - tic)


def choose_batch_size(
    model: nn.Module,
    *,
    tokens_per_sequence: int,
    num_prompts: int,
    context: int = 1,
    memory: int | None = None,
) -> tuple[int, dict[str, Any]]:
    """The batch size for a job: what fits in memory, then the knee of the throughput curve.

    The curve is measured at doubling batch sizes until the throughput stops growing by more
    than 1 / KNEE for two doublings in a row (a few decode steps each), within ``CURVE_SECONDS``;
    the smallest size within KNEE of the best wins.

    Args:
        tokens_per_sequence: prompt + completion tokens of a typical sequence (KV it needs).
        num_prompts: no batch larger than the job.
        context: cached tokens during the throughput measurement.
        memory: bytes available (default ``available_memory()``).

    Returns:
        ``(batch_size, report)``; the report holds the memory cap and the measured curve.
    """
    memory = available_memory() if memory is None else memory
    per_sequence = kv_bytes_per_token(model) * max(tokens_per_sequence, 1)
    budget = MEMORY_FRACTION * memory - model_bytes(model)
    memory_cap = max(int(budget // per_sequence), 1)
    cap = min(memory_cap, num_prompts, CURVE_SIZES[-1])
    curve: dict[int, float] = {}
    stalls, tic = 0, time.perf_counter()
    for candidate in CURVE_SIZES:
        if candidate > cap or stalls == 2 or time.perf_counter() - tic > CURVE_SECONDS:
            break
        previous = max(curve.values(), default=0.0)
        curve[candidate] = decode_throughput(model, candidate, context)
        stalls = stalls + 1 if curve[candidate] < previous / KNEE else 0
    best = max(curve.values())
    size = min(s for s, rate in curve.items() if rate >= KNEE * best)
    if size == max(curve) and cap > size:  # still climbing at the largest size measured
        size = min(cap, 2 * size)
    report = {"memory_cap": memory_cap, "kv_bytes_per_sequence": per_sequence,
              "tokens_per_s": {str(s): round(r, 1) for s, r in curve.items()}}
    return size, report


# -- running a batch -----------------------------------------------------------------------------


def shared_prefix(prompts: Sequence[Sequence[int]]) -> list[int]:
    """The tokens every prompt starts with (a chat template and system prompt, few-shot
    examples), if at least ``MIN_SHARED_PREFIX`` and two prompts share them; else empty."""
    if len(prompts) < 2:
        return []
    first, length = prompts[0], min(len(p) for p in prompts)
    for p in prompts[1:]:
        length = next((i for i in range(length) if p[i] != first[i]), length)
    return list(first[:length]) if length >= MIN_SHARED_PREFIX else []


def chat_template_prefix(tokenizer: Any) -> list[int]:
    """The tokens every chat prompt of this model starts with (its template's opening and any
    default system prompt), if long enough to be worth sharing (:func:`shared_prefix`);
    empty without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    return shared_prefix([chat_prompt(tokenizer, [{"role": "user", "content": text}])
                          for text in ("Hello.", "What is 2 + 2?")])


def iter_batch(
    engine: Engine,
    requests: Iterable[tuple[Any, Request | Exception]],
    batch_size: int,
    on_token: Callable[[int], None] | None = None,
) -> Iterator[tuple[Any, BatchResult]]:
    """Run ``(key, request)`` pairs through ``engine`` at most ``batch_size`` at a time.

    A pair whose request is an exception yields its error at once. Results come as each finishes
    (not in input order). ``on_token(n)`` is told of every n tokens generated.
    """
    pending = iter(requests)
    keys: dict[int, Any] = {}
    texts: dict[int, list[str]] = {}
    exhausted = False
    while True:
        while not exhausted and len(keys) < batch_size:
            item = next(pending, None)
            if item is None:
                exhausted = True
                break
            key, request = item
            if isinstance(request, Exception):
                yield key, BatchResult(error=str(request))
                continue
            try:
                rid = engine.submit(request)
            except ValueError as e:
                yield key, BatchResult(error=str(e))
                continue
            keys[rid], texts[rid] = key, []
        if not keys:
            return
        events = engine.step()
        if on_token is not None:
            on_token(sum(e.token is not None for e in events))
        for event in events:
            texts[event.rid].append(event.text)
            if event.finish_reason is not None:
                yield keys.pop(event.rid), BatchResult(
                    text="".join(texts.pop(event.rid)),
                    finish_reason=event.finish_reason,
                    prompt_tokens=event.prompt_tokens,
                    completion_tokens=event.completion_tokens,
                )


def batch_generate(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompts: Sequence[str | Sequence[int] | Request],
    *,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    stop: Sequence[str] = (),
    batch_size: int | None = None,
    draft_model: nn.Module | None = None,
    draft_tokenizer: TokenizerWrapper | None = None,
    prompt_lookup: bool = False,
) -> list[BatchResult]:
    """Generate completions for many prompts with continuous batching; results in input order.

    Args:
        prompts: text (BOS added as the tokenizer wants; no chat template), token ids, or
            ``mlxspec.serving.engine.Request`` objects (their own sampling settings win).
        max_tokens, temp, top_p, top_k, min_p, stop: settings for text / token prompts.
        batch_size: sequences decoded together (default: ``choose_batch_size``).
        draft_model, draft_tokenizer, prompt_lookup: speculative decoding for the job's tail,
            when one sequence is left.
    """
    requests = [
        p if isinstance(p, Request) else Request(
            encode_prompt(tokenizer, p).tolist(), max_tokens=max_tokens, temp=temp, top_p=top_p,
            top_k=top_k, min_p=min_p, stop=tuple(stop))
        for p in prompts
    ]
    if not requests:
        return []
    if batch_size is None:
        longest = max(len(r.prompt) + r.max_tokens for r in requests)
        batch_size, _ = choose_batch_size(
            model, tokens_per_sequence=longest, num_prompts=len(requests))
    draft = make_draft(model, tokenizer, draft_model=draft_model,
                       draft_tokenizer=draft_tokenizer, prompt_lookup=prompt_lookup)
    engine = Engine(model, tokenizer, max_batch=batch_size, draft=draft, prompt_cache_size=0)
    engine.share_prefix(shared_prefix([r.prompt for r in requests]))
    results: list[BatchResult] = [BatchResult() for _ in requests]
    try:
        for index, result in iter_batch(engine, enumerate(requests), batch_size):
            results[index] = result
    finally:
        engine.close()
    return results
