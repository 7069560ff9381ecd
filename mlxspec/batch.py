"""Offline batch generation: many prompts through one continuously batched ``Engine``.

``batch_generate`` is the Python API (results in input order); ``run_jsonl`` is the job behind
``mlxspec batch``: one JSON object per line in, one per line out, resumable, with per-request
errors recorded instead of ending the job. ``choose_batch_size`` sizes the batch from the memory
each sequence needs and a measured throughput curve.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlxspec.engine import Engine, Request, make_draft
from mlxspec.generate import encode_prompt
from mlxspec.load import model_bytes

CURVE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # batch sizes the throughput curve is measured at
KNEE = 0.9  # doubling the batch must raise the throughput by 1 / KNEE (11 %) to be worth it
MEMORY_FRACTION = 0.6  # of the available memory, for weights + KV caches
CURVE_SECONDS = 10.0  # time the throughput curve may take; larger sizes go unmeasured after it


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
        return int(mx.metal.device_info()["max_recommended_working_set_size"])
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
    model(mx.zeros((batch, context), mx.int32), cache=cache)
    mx.eval([c.state for c in cache])
    y = mx.zeros((batch, 1), mx.int32)
    mx.eval(model(y, cache=cache))  # warm-up
    tic = time.perf_counter()
    for _ in range(steps):
        mx.eval(model(y, cache=cache))
    return batch * steps / (time.perf_counter() - tic)


def choose_batch_size(
    model: nn.Module,
    *,
    tokens_per_sequence: int,
    num_prompts: int,
    context: int = 4,
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
            ``mlxspec.engine.Request`` objects (their own sampling settings win).
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
    results: list[BatchResult] = [BatchResult() for _ in requests]
    try:
        for index, result in iter_batch(engine, enumerate(requests), batch_size):
            results[index] = result
    finally:
        engine.close()
    return results


# -- the JSONL job ---------------------------------------------------------------------------------

SAMPLING_FIELDS = {"max_tokens": int, "temperature": float, "temp": float, "top_p": float,
                   "top_k": int, "min_p": float, "seed": int}


def _chat_prompt(tokenizer: TokenizerWrapper, messages: list[dict]) -> list[int]:
    # LEAD: replace with mlxspec.chat.chat_prompt(tokenizer, messages) at merge (core's one home
    # of the chat template); the same function serves mlxspec.serve.
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def parse_line(
    line: str, number: int, tokenizer: TokenizerWrapper, defaults: dict[str, Any]
) -> tuple[str, Request | Exception]:
    """``(id, request)`` of one input line, or ``(id, error)`` for a line that cannot run.

    A line is ``{"id", "prompt" | "messages", optional sampling fields}``; without an id the line
    number (from 1) is its id. ``prompt`` is raw text; ``messages`` gets the chat template.
    """
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return f"line-{number}", ValueError(f"line {number} is not JSON: {e.msg}")
    if not isinstance(record, dict):
        return f"line-{number}", ValueError(f"line {number} is not a JSON object")
    key = str(record.get("id", f"line-{number}"))
    try:
        return key, _request(record, tokenizer, defaults)
    except (ValueError, TypeError, KeyError) as e:
        return key, ValueError(f"line {number}: {e}")


def _request(record: dict, tokenizer: TokenizerWrapper, defaults: dict[str, Any]) -> Request:
    settings = dict(defaults)
    for name, kind in SAMPLING_FIELDS.items():
        if name in record:
            value = record[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number")
            settings["temp" if name == "temperature" else name] = kind(value)
    if "stop" in record:
        stop = record["stop"]
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ValueError("stop must be a string or a list of strings")
        settings["stop"] = tuple(stop)
    if isinstance(record.get("messages"), list) and record["messages"]:
        prompt = _chat_prompt(tokenizer, record["messages"])
    elif isinstance(record.get("prompt"), str) and record["prompt"]:
        prompt = encode_prompt(tokenizer, record["prompt"]).tolist()
    else:
        raise ValueError('give a non-empty "prompt" (text) or "messages" (chat) field')
    if settings.get("max_tokens", 1) < 1:
        raise ValueError("max_tokens must be at least 1")
    return Request(prompt, **settings)


def done_ids(out_path: Path) -> set[str]:
    """Ids already in ``out_path``; a partial last line (an interrupted write) is cut off."""
    if not out_path.exists():
        return set()
    data = out_path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(out_path, "r+b") as f:
            f.truncate(cut)
        data = data[:cut]
    ids = set()
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            ids.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return ids


def run_jsonl(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    in_path: str | Path,
    out_path: str | Path,
    *,
    defaults: dict[str, Any] | None = None,
    batch_size: int | None = None,
    draft: Any = None,
    num_draft_tokens: int | str = "auto",
    progress: bool | None = None,
) -> dict[str, Any]:
    """The ``mlxspec batch`` job: results appended to ``out_path`` one line each, as they finish.

    Each output line is ``{"id", "text", "finish_reason", "prompt_tokens", "completion_tokens"}``
    or ``{"id", "error"}``. Ids already in ``out_path`` are skipped (resume after a crash, which
    loses at most the in-flight batch: each line is written with one append).

    Returns:
        A summary: counts, tokens, seconds, tokens/s, batch size and how it was chosen.
    """
    in_path, out_path = Path(in_path), Path(out_path)
    defaults = dict(defaults or {})
    seed = defaults.pop("seed", None)  # the job's seed: once, not per request
    if seed is not None:
        mx.random.seed(seed)
    skip = done_ids(out_path)
    lines = [(n, line) for n, line in enumerate(in_path.read_text().splitlines(), 1)
             if line.strip()]
    seen: set[str] = set()
    jobs = []
    for number, line in lines:
        key, request = parse_line(line, number, tokenizer, defaults)
        if key in seen:
            request = ValueError(f"line {number}: duplicate id {key!r}")
            key = f"line-{number}"
        seen.add(key)
        if key not in skip:
            jobs.append((key, request))
    summary: dict[str, Any] = {"total": len(lines), "skipped": len(lines) - len(jobs)}
    runnable = [r for _, r in jobs if isinstance(r, Request)]
    sizing = None
    if batch_size is None and runnable:
        longest = max(len(r.prompt) + r.max_tokens for r in runnable)
        batch_size, sizing = choose_batch_size(
            model, tokens_per_sequence=longest, num_prompts=len(runnable))
    batch_size = batch_size or 1
    engine = Engine(model, tokenizer, max_batch=batch_size, draft=draft,
                    num_draft_tokens=num_draft_tokens, prompt_cache_size=0)
    expected = sum(r.max_tokens for r in runnable)
    ok = errors = tokens = 0
    tic = time.perf_counter()
    fd = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    bar = _Progress(len(jobs), expected, enabled=progress)
    try:
        for key, result in iter_batch(engine, jobs, batch_size, on_token=bar.tokens):
            record = {"id": key}
            if result.error is not None:
                record["error"] = result.error
                errors += 1
            else:
                record.update(text=result.text, finish_reason=result.finish_reason,
                              prompt_tokens=result.prompt_tokens,
                              completion_tokens=result.completion_tokens)
                ok += 1
                tokens += result.completion_tokens
            os.write(fd, (json.dumps(record, ensure_ascii=False) + "\n").encode())
            bar.done(result)
    finally:
        os.close(fd)
        bar.close()
        engine.close()
    seconds = time.perf_counter() - tic
    summary.update(completed=ok, errors=errors, generated_tokens=tokens,
                   seconds=round(seconds, 3), tokens_per_s=round(tokens / max(seconds, 1e-9), 2),
                   batch_size=batch_size, sizing=sizing)
    return summary


class _Progress:
    """A rich progress bar over the generated tokens (tokens/s, ETA), on a terminal only."""

    def __init__(self, requests: int, expected_tokens: int, enabled: bool | None):
        enabled = sys.stderr.isatty() if enabled is None else enabled
        self.bar = None
        if not enabled or requests == 0:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("batch"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[rate]:.1f} tok/s"), TimeRemainingColumn(),
            transient=False,
        )
        self.task = self.bar.add_task("batch", total=requests, rate=0.0)
        self.tic, self.count = time.perf_counter(), 0
        self.bar.start()

    def tokens(self, n: int) -> None:
        if self.bar is not None:
            self.count += n
            rate = self.count / max(time.perf_counter() - self.tic, 1e-9)
            self.bar.update(self.task, rate=rate)

    def done(self, result: BatchResult) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
