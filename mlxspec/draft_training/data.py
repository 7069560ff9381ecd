"""The training set of a feature draft: the target's own answers to instructions.

Samples are appended to ``samples.jsonl`` as each chunk of the batch finishes (one JSON object a
line: ``{"id", "instruction", "prompt": [ids], "response": [ids]}``), so an interrupted run keeps
every finished answer and a rerun generates only the missing ones. A line cut short by a kill is
ignored (and regenerated).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlxspec.chat_template import chat_prompt
from mlxspec.errors import InvalidArgumentError
from mlxspec.progress import progress_bar

SAMPLES = "samples.jsonl"
SAMPLED_EVERY = 3  # every third answer is sampled at SAMPLED_TEMP (diversity), the rest greedy
SAMPLED_TEMP = 0.7


def read_instructions(path: Path) -> list[str]:
    """Instructions from a JSONL file: ``{"instruction": str}`` or ``{"prompt": str}`` a line.

    Raises:
        InvalidArgumentError: a line is not such an object.
    """
    items = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            items.append(str(row.get("instruction", row.get("prompt"))))
            if items[-1] == "None":
                raise KeyError("instruction")
        except (ValueError, KeyError, AttributeError) as e:
            raise InvalidArgumentError(
                f"{path}:{number}: expected a JSON object with an \"instruction\" string ({e})"
            ) from e
    return items


def read_samples(directory: Path) -> list[dict[str, Any]]:
    """The complete samples in ``directory`` (a truncated last line is skipped)."""
    path = Path(directory) / SAMPLES
    samples = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # cut short by an interruption: regenerated
            if isinstance(row, dict) and {"id", "prompt", "response"} <= row.keys():
                samples.append(row)
    return samples


def generate_samples(
    model: Any,
    tokenizer: Any,
    instructions: Sequence[str],
    directory: Path,
    *,
    max_tokens: int = 256,
    batch_size: int | None = None,
    show_progress: bool = True,
) -> list[dict[str, Any]]:
    """Answer every instruction with the target (batched), appending to ``directory/samples.jsonl``.

    Args:
        instructions: user messages; each is rendered with the chat template.
        max_tokens: the longest answer, in tokens.
        batch_size: sequences decoded together (default: ``choose_batch_size``).

    Returns:
        The samples of ``instructions`` (earlier runs' included), in id order.
    """
    from mlxspec.serving.batch import batch_generate, choose_batch_size
    from mlxspec.serving.requests import Request

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    done = {row["id"]: row for row in read_samples(directory)}
    todo = [i for i in range(len(instructions)) if i not in done]
    if todo and batch_size is None:
        batch_size, _ = choose_batch_size(model, tokens_per_sequence=max_tokens + 64,
                                          num_prompts=len(todo))
    path = directory / SAMPLES
    _end_with_newline(path)
    chunk = 2 * (batch_size or 1)  # answers saved every chunk: a kill loses at most one
    eos = tokenizer.eos_token_id  # the end-of-turn token the text's stop stands for
    with progress_bar("answering instructions", len(todo), show_progress) as advance, \
            open(path, "a") as out:
        for start in range(0, len(todo), chunk):
            ids = todo[start : start + chunk]
            prompts = [chat_prompt(tokenizer, [{"role": "user", "content": instructions[i]}])
                       for i in ids]
            requests = [Request(p, max_tokens=max_tokens,
                                temp=SAMPLED_TEMP if i % SAMPLED_EVERY == SAMPLED_EVERY - 1 else 0.0)
                        for i, p in zip(ids, prompts, strict=True)]
            results = batch_generate(model, tokenizer, requests, batch_size=batch_size)
            for i, prompt, result in zip(ids, prompts, results, strict=True):
                if result.error:
                    continue
                response = tokenizer.encode(result.text, add_special_tokens=False)
                if result.finish_reason == "stop" and eos is not None:
                    response.append(eos)
                row = {"id": i, "instruction": instructions[i], "prompt": prompt,
                       "response": response}
                out.write(json.dumps(row) + "\n")
                done[i] = row
                advance()
            out.flush()
    return [done[i] for i in sorted(done) if i < len(instructions)]


def _end_with_newline(path: Path) -> None:
    """A line cut short by a kill must not swallow the next sample written."""
    if path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
        with open(path, "a") as out:
            out.write("\n")
