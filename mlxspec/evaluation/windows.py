"""Token windows to evaluate on: the built-in held-out text or any UTF-8 text file (streamed).

A window of T tokens is scored at its positions 1..T-1 (each predicted from the tokens before
it). Windows are consecutive and do not overlap; a last partial window is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from importlib.resources import files
from pathlib import Path

from mlxspec.errors import EvaluationError

DEFAULT_WINDOWS = 8
DEFAULT_WINDOW_TOKENS = 256
CHUNK_CHARS = 1 << 14  # text is tokenized this many characters at a time
BUILTIN_TEXT_TITLE = "Jane Austen, *Persuasion*, chapters 1-6"  # data/eval.txt, see PROVENANCE.md


def builtin_text() -> str:
    """The held-out evaluation prose shipped with the package (``mlxspec/data/eval.txt``),
    disjoint from the quantizers' calibration text."""
    return (files("mlxspec") / "data" / "eval.txt").read_text(encoding="utf-8")


def encode(tokenizer, text: str) -> list[int]:
    """Plain text tokens, no BOS/EOS: windows are cut from the middle of a long text."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def check_window_args(windows: int | None, window_tokens: int) -> None:
    if window_tokens < 2:
        raise EvaluationError(f"window length {window_tokens} is too short: use at least 2 tokens")
    if windows is not None and windows < 1:
        raise EvaluationError(f"{windows} windows asked for: use at least 1")


def builtin_windows(
    tokenizer, windows: int | None = DEFAULT_WINDOWS, window_tokens: int = DEFAULT_WINDOW_TOKENS
) -> list[list[int]]:
    """Consecutive, non-overlapping windows of the built-in evaluation text.

    Args:
        tokenizer: anything with ``encode(text, add_special_tokens=False)`` (a TokenizerWrapper).
        windows: number of windows; None takes every whole window the text holds.
        window_tokens: tokens per window.

    Returns:
        ``windows`` lists of ``window_tokens`` token ids, in text order.
    """
    check_window_args(windows, window_tokens)
    text = builtin_text()
    chunks = (text[i : i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS))
    out = list(_windows(tokenizer, _whole_lines(chunks), window_tokens))
    if windows is not None and windows > len(out):
        raise EvaluationError(
            f"the built-in text holds {len(out)} windows of {window_tokens} tokens, not "
            f"{windows}: ask for fewer or shorter windows, or pass --text FILE"
        )
    return out if windows is None else out[:windows]


def text_windows(
    tokenizer, path: str | Path, window_tokens: int = DEFAULT_WINDOW_TOKENS
) -> Iterator[list[int]]:
    """Stream consecutive windows of ``window_tokens`` tokens from a UTF-8 text file.

    The file is read and tokenized ``CHUNK_CHARS`` characters at a time (cut at line ends), so
    memory stays bounded on long files; a last partial window is dropped.
    """
    check_window_args(None, window_tokens)
    path = Path(path)
    if not path.is_file():
        raise EvaluationError(f"text file not found: {path}")
    try:
        with path.open(encoding="utf-8") as f:
            chunks = iter(lambda: f.read(CHUNK_CHARS), "")
            yield from _windows(tokenizer, _whole_lines(chunks), window_tokens)
    except UnicodeDecodeError as e:
        raise EvaluationError(f"{path} is not UTF-8 text: {e.reason}") from e


def take_windows(
    tokenizer, text: str | Path | None, windows: int | None, window_tokens: int
) -> list[list[int]]:
    """``windows`` windows from ``text`` (a file), or from the built-in text when it is None."""
    if text is None:
        return builtin_windows(tokenizer, windows, window_tokens)
    check_window_args(windows, window_tokens)
    out = []
    for window in text_windows(tokenizer, text, window_tokens):
        out.append(window)
        if windows is not None and len(out) == windows:
            break
    if not out or (windows is not None and len(out) < windows):
        raise EvaluationError(
            f"{text} holds {len(out)} windows of {window_tokens} tokens, fewer than {windows}: "
            "ask for fewer or shorter windows, or give a longer text"
        )
    return out


def _whole_lines(chunks: Iterable[str]) -> Iterator[str]:
    """Re-cut text chunks at line ends, so that no word is split between two tokenizer calls."""
    carry = ""
    for chunk in chunks:
        head, sep, tail = (carry + chunk).rpartition("\n")
        if sep:
            yield head + sep
            carry = tail
        else:
            carry = tail
    if carry:
        yield carry


def _windows(tokenizer, chunks: Iterable[str], window_tokens: int) -> Iterator[list[int]]:
    pending: list[int] = []
    for chunk in chunks:
        pending.extend(encode(tokenizer, chunk))
        while len(pending) >= window_tokens:
            yield pending[:window_tokens]
            pending = pending[window_tokens:]
