"""Rebuild the calibration and evaluation texts of ``mlxspec/data`` from their sources
(``PROVENANCE.md`` says where each comes from and under which licence).

    apt-get install bible-kjv dict-devil            # the KJV reader and The Devil's Dictionary
    python mlxspec/data/build_texts.py              # every text but the chat answers
    python mlxspec/data/build_texts.py --chat       # + eval_chat.jsonl (runs SmolLM2, ~2 min)

Not installed with the package (only the texts are): it documents, byte for byte, how they were
cut. Calibration and evaluation always take different parts of a source (other books of the
Bible, other letters of the dictionary, other stdlib modules, other reference topics, other
prompts), which ``tests/evaluation/test_domains.py`` checks on the shipped files.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEVIL = Path("/usr/share/dictd/devil.dict.dz")
# Python's standard library (PSF licence): whole modules, calibration and evaluation disjoint.
CODE_CALIBRATION = ("textwrap.py", "heapq.py", "fractions.py", "bisect.py", "colorsys.py")
CODE_EVALUATION = ("shlex.py", "graphlib.py", "sched.py", "calendar.py")
TECHNICAL_BYTES = 60_000  # of Python's language reference (pydoc_data.topics) per side
BIBLE_CALIBRATION = ("Genesis 1:1-Genesis 11:32",)
BIBLE_EVALUATION = ("Luke 1:1-Luke 3:38",)
DEVIL_CALIBRATION = "ABCD"  # first letters of the dictionary's entries
DEVIL_EVALUATION = "STUVWXYZ"


def _write(name: str, text: str) -> None:
    (HERE / name).write_text(text.rstrip("\n") + "\n", encoding="utf-8")
    print(f"{name}: {len((HERE / name).read_bytes()):,} bytes")


def bible(passages: tuple[str, ...]) -> str:
    """KJV verses (``bible -f``), the verse references dropped, one paragraph per chapter."""
    chapters: dict[str, list[str]] = {}
    for passage in passages:
        out = subprocess.run(["bible", "-f", passage], capture_output=True, text=True,
                             check=True).stdout
        for line in out.splitlines():
            m = re.match(r"^(\w+?\d+):\d+ (.*)$", line.strip())
            if m:
                chapters.setdefault(m.group(1), []).append(m.group(2))
    return "\n\n".join(" ".join(v) for v in chapters.values())


def _shingles(text: str, n: int = 10) -> set[tuple[str, ...]]:
    words = text.split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def devil(letters: str, avoid: str = "") -> str:
    """The Devil's Dictionary's entries whose headword starts with one of ``letters``, without
    those that repeat a 10-word passage of ``avoid`` (the book quotes itself)."""
    text = gzip.decompress(DEVIL.read_bytes()).decode("latin-1")
    body = text[text.index("\nABASEMENT, n."):]  # after dictd's header and the preface
    body = body.split("\n abcdefghijklmnopqrstuvwxyz")[0]  # dictd's trailing index
    entries = re.split(r"\n(?=[A-Z][A-Z'\- ]+[,.] )", body)
    keep = [e.strip() for e in entries if e.strip() and e.strip()[0] in letters]
    seen = _shingles(avoid)
    return "\n\n".join(e for e in keep if not _shingles(e) & seen)


def stdlib(modules: tuple[str, ...]) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((root / m).read_text(encoding="utf-8") for m in modules)


def reference_topics(parity: int, avoid: str = "") -> str:
    """Python's language reference (``pydoc_data.topics``): every other topic, sorted by name,
    up to ``TECHNICAL_BYTES``, without topics that repeat a 10-word passage of ``avoid`` (the
    reference repeats sections, e.g. the compound statements in each statement's topic)."""
    from pydoc_data.topics import topics

    out, size, seen = [], 0, _shingles(avoid)
    for name in sorted(topics)[parity::2]:
        if size >= TECHNICAL_BYTES:
            break
        if _shingles(topics[name]) & seen:
            continue
        out.append(topics[name].strip())
        size += len(out[-1])
    return "\n\n".join(out)


def chat_answers(prompts_file: str, out: str) -> None:
    """The float SmolLM2's answers to held-out prompts, as conversations (JSON lines)."""
    import mlxspec
    from mlxspec.publish.self_calibration import generate_conversations

    model, tokenizer = mlxspec.load()
    prompts = (HERE / prompts_file).read_text(encoding="utf-8").splitlines()
    conversations = generate_conversations(model, tokenizer, prompts, progress=True)
    (HERE / out).write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations),
                            encoding="utf-8")
    print(f"{out}: {len(conversations)} conversations")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chat", action="store_true", help="also generate eval_chat.jsonl")
    args = parser.parse_args()
    calibration_prose = bible(BIBLE_CALIBRATION) + "\n\n" + devil(DEVIL_CALIBRATION)
    _write("calibration_prose.txt", calibration_prose)
    _write("eval_prose.txt",
           bible(BIBLE_EVALUATION) + "\n\n" + devil(DEVIL_EVALUATION, avoid=calibration_prose))
    _write("calibration_code.txt", stdlib(CODE_CALIBRATION))
    _write("eval_code.txt", stdlib(CODE_EVALUATION))
    calibration_technical = reference_topics(0)
    _write("calibration_technical.txt", calibration_technical)
    _write("eval_technical.txt", reference_topics(1, avoid=calibration_technical))
    if args.chat:
        chat_answers("eval_prompts.txt", "eval_chat.jsonl")


if __name__ == "__main__":
    main()
