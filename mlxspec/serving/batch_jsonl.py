"""The ``mlxspec batch`` job: a JSONL file of prompts in, a JSONL file of results out.

One JSON object per line in (``{"id", "prompt" | "messages", optional sampling fields and
``json_schema``}``: the answer is then JSON valid under that schema, by constrained decoding), one
per line out, appended as each request finishes: resumable (ids already in the output are
skipped; a partial last line from a crash is cut off), with per-request errors recorded instead
of ending the job, and a progress bar (tokens/s, ETA) on a terminal.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlxspec.chat_template import chat_prompt
from mlxspec.generate import encode_prompt
from mlxspec.grammar import json_schema_grammar
from mlxspec.serving.batch import choose_batch_size, iter_batch, shared_prefix
from mlxspec.serving.engine import Engine, Request

SAMPLING_FIELDS = {"max_tokens": int, "temperature": float, "temp": float, "top_p": float,
                   "top_k": int, "min_p": float, "seed": int}


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
    except Exception as e:  # noqa: BLE001  (a line's error is recorded, never fatal to the job)
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
    if "json_schema" in record:  # constrained decoding: the answer is JSON valid under it
        schema = record["json_schema"]
        if not isinstance(schema, dict):
            raise ValueError("json_schema must be a JSON schema (an object)")
        settings["grammar"] = json_schema_grammar(schema)
    if isinstance(record.get("messages"), list) and record["messages"]:
        prompt = chat_prompt(tokenizer, record["messages"])
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
    make_engine: Callable[..., Engine] = Engine,
) -> dict[str, Any]:
    """The ``mlxspec batch`` job: results appended to ``out_path`` one line each, as they finish.

    Each output line is ``{"id", "text", "finish_reason", "prompt_tokens", "completion_tokens"}``
    or ``{"id", "error"}``. Ids already in ``out_path`` are skipped (resume after a crash, which
    loses at most the in-flight batch: each line is written with one append).

    ``make_engine``: builds the engine (``mlxspec.distributed.engine.LeadingEngine``: a sharded
    job's rank 0).

    Returns:
        A summary: counts, tokens, seconds, tokens/s, batch size and how it was chosen.
    """
    in_path, out_path = Path(in_path), Path(out_path)
    defaults = dict(defaults or {})
    seed = defaults.pop("seed", None)  # the job's seed: once, not per request
    if seed is not None:
        mx.random.seed(seed)
    skip = done_ids(out_path)
    text = in_path.read_text(encoding="utf-8", errors="replace")  # a bad line fails alone
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
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
    engine = make_engine(model, tokenizer, max_batch=batch_size, draft=draft,
                         num_draft_tokens=num_draft_tokens, prompt_cache_size=0)
    engine.share_prefix(shared_prefix([r.prompt for r in runnable]))
    budgets = {key: r.max_tokens for key, r in jobs if isinstance(r, Request)}
    expected = sum(budgets.values())
    ok = errors = tokens = 0
    tic = time.perf_counter()
    out_path.parent.mkdir(parents=True, exist_ok=True)
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
            bar.done(budgets.get(key, 0) - result.completion_tokens)
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
    """A rich progress bar on a terminal: tokens against the jobs' max_tokens budget (a request
    that ends early gives back the rest), with requests done, tokens/s and ETA."""

    def __init__(self, requests: int, expected_tokens: int, enabled: bool | None):
        enabled = sys.stderr.isatty() if enabled is None else enabled
        self.bar = None
        if not enabled or requests == 0:
            return
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("batch"), BarColumn(),
            TextColumn("{task.fields[done]}/{task.fields[requests]} requests"),
            TextColumn("{task.fields[rate]:.1f} tok/s"), TimeRemainingColumn(),
        )
        self.task = self.bar.add_task("batch", total=max(expected_tokens, 1), rate=0.0, done=0,
                                      requests=requests)
        self.tic, self.count, self.done_count = time.perf_counter(), 0, 0
        self.bar.start()

    def tokens(self, n: int) -> None:
        if self.bar is not None:
            self.count += n
            rate = self.count / max(time.perf_counter() - self.tic, 1e-9)
            self.bar.update(self.task, advance=n, rate=rate)

    def done(self, unused_tokens: int) -> None:
        if self.bar is not None:
            self.done_count += 1
            self.bar.update(self.task, advance=max(unused_tokens, 0), done=self.done_count)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
