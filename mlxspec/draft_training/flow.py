"""``train_draft``: the whole flow behind ``mlxspec train-draft``, callable from Python.

1. the target answers the instructions (batched; ``data``), and the held-out ones;
2. its fused taps and top-K choices on every answer (``features``);
3. the EAGLE-3 recipe trains a one-layer head (``recipe``, ``train``), checkpointing;
4. predicted and measured acceptance on the held-out instructions (``evaluate``);
5. the head (EAGLE-3 layout, float16) and its card are written to a temporary directory that
   is renamed to ``out``.

Everything but the result lives in the work directory (default ``<out>.train``): rerunning the
same command after an interruption continues where it stopped and loses nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mlxspec.draft_training.data import generate_samples, read_instructions
from mlxspec.draft_training.evaluate import (
    expected_tokens_per_pass,
    measured_acceptance,
    predicted_acceptance,
)
from mlxspec.draft_training.features import compute_features, draft_vocabulary, load_shards
from mlxspec.draft_training.instructions import held_out, training_instructions
from mlxspec.draft_training.recipe import new_head
from mlxspec.draft_training.train import TrainSettings, load_checkpoint, train
from mlxspec.errors import OutputExistsError
from mlxspec.speculative.eagle3 import CONFIG, save_eagle3

VOCAB_FILE = "draft_vocab.json"


def _check_output(out: Path) -> None:
    """``out`` may be new, empty, or a head this command wrote (replaced whole)."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    try:
        ours = "mlxspec" in json.loads((out / CONFIG).read_text())
    except (OSError, ValueError):
        ours = False
    if not ours:
        raise OutputExistsError(f"{out} exists and is not a draft head written by mlxspec: "
                                "choose another --out or remove it")


def _vocabulary(work: Path, samples: list[dict], size: int, always: list[int]) -> list[int]:
    """The draft vocabulary, fixed at the first run (a resumed run must keep its head's)."""
    path = work / VOCAB_FILE
    if path.exists():
        return json.loads(path.read_text())
    ids = draft_vocabulary(samples, size, always)
    path.write_text(json.dumps(ids))
    return ids


def train_draft(
    model: str | None, out: str | Path, *, instructions: str | Path | None = None,
    work: str | Path | None = None, draft_vocab: int = 8192,
    settings: TrainSettings | None = None, minutes: float | None = None, max_tokens: int = 256,
    limit: int | None = None, held_out_count: int = 12, batch_size: int | None = None,
    command: str = "", show_progress: bool = True,
) -> dict[str, Any]:
    """Train an EAGLE-3 head for ``model`` (None: the default model) and write it to ``out``.

    Args:
        instructions: a JSONL file of ``{"instruction": ...}`` lines (default: the built-in set).
        work: where data, features and checkpoints are kept (default ``<out>.train``).
        draft_vocab: tokens the head scores (the target's most frequent answer tokens).
        settings: steps, batch, TTT steps, learning rate (``TrainSettings``).
        minutes: stop training after this long (a checkpoint is kept; rerun to continue).
        max_tokens: the longest generated answer.
        limit: use only the first ``limit`` instructions (quick runs, tests).
        batch_size: answers generated together (default: measured, ``choose_batch_size``).
        command: the command line, recorded on the card.

    Returns:
        The report written to ``out/training.json``.
    """
    from mlxspec.load import load
    from mlxspec.paths import locked_directory
    from mlxspec.speculative.tokenizers import tokenizer_fingerprint

    out, settings = Path(out), settings or TrainSettings()
    work = Path(work) if work is not None else out.with_name(out.name + ".train")
    _check_output(out)
    work.mkdir(parents=True, exist_ok=True)
    with locked_directory(work):
        target, tokenizer = load(model)
        items = read_instructions(Path(instructions)) if instructions else training_instructions()
        items = items[:limit] if limit else items
        held_items = held_out(held_out_count)
        samples = generate_samples(target, tokenizer, items, work / "data", max_tokens=max_tokens,
                                   batch_size=batch_size, show_progress=show_progress)
        held = generate_samples(target, tokenizer, held_items, work / "held_out",
                                max_tokens=max_tokens, batch_size=batch_size,
                                show_progress=show_progress)
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        draft_ids = _vocabulary(work, samples, draft_vocab, eos)
        extra = {"target": str(model or "default (SmolLM2-135M-Instruct)"),
                 "tokenizer_sha256": tokenizer_fingerprint(tokenizer)}
        head = new_head(target, draft_ids, extra)
        taps = head.config.taps
        data = load_shards(compute_features(target, samples, work / "features", taps,
                                            show_progress))
        held_data = load_shards(compute_features(target, held, work / "held_features", taps,
                                                 show_progress))
        deadline = None if minutes is None else time.monotonic() + 60 * minutes
        log = train(head, data, work, settings, show_progress,
                    should_stop=lambda: deadline is not None and time.monotonic() > deadline,
                    evaluate=lambda h: predicted_acceptance(h, held_data, settings.ttt_steps))
        step = load_checkpoint(work, head, _optimizer_stub())[0]
        agreement = predicted_acceptance(head, held_data, settings.ttt_steps)
        measured = measured_acceptance(target, tokenizer, head, held_items, max_tokens=max_tokens)
        kept = set(draft_ids)
        answers = [t for sample in held for t in sample["response"]]
        coverage = sum(t in kept for t in answers) / max(len(answers), 1)
        report = {
            "target": extra["target"], "command": command, "steps": step,
            "settings": asdict(settings), "instructions": len(items),
            "answer_tokens": sum(len(s["response"]) for s in samples),
            "draft_vocab": len(draft_ids), "taps": taps,
            "held_out_coverage": round(coverage, 4),  # answer tokens inside the draft vocab
            "held_out": {"instructions": len(held_items), "agreement_per_step": agreement,
                         "predicted_tokens_per_pass": expected_tokens_per_pass(agreement),
                         "measured": measured},
            "log": log,
        }
        head.config.extra = {**extra, "steps": step, "measured": measured}
        _write_head(out, head, report)
    return report


def _optimizer_stub() -> Any:
    import mlx.optimizers as optim

    return optim.AdamW(learning_rate=0.0)


def _write_head(out: Path, head: Any, report: dict[str, Any]) -> None:
    """The head, its card and report into a temporary directory, then renamed to ``out``."""
    temporary = out.with_name(out.name + ".partial")
    shutil.rmtree(temporary, ignore_errors=True)
    save_eagle3(head, temporary)
    (temporary / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    (temporary / "README.md").write_text(card(report))
    if out.exists():
        shutil.rmtree(out)
    os.replace(temporary, out)


def card(report: dict[str, Any]) -> str:
    """The head's model card (markdown): what it drafts for, how it was trained, how it does."""
    held = report["held_out"]
    measured = held["measured"]
    return "\n".join([
        f"# EAGLE-3 draft head for {report['target']}", "",
        "A one-layer EAGLE-3 head (SpecForge / vLLM `LlamaForCausalLMEagle3` layout, float16) "
        "trained by `mlxspec train-draft` on the target's own answers.", "",
        f"- command: `{report['command']}`" if report["command"] else "- command: (Python API)",
        f"- data: {report['instructions']} instructions, {report['answer_tokens']} answer tokens",
        f"- draft vocabulary: {report['draft_vocab']} tokens; taps (layer inputs): {report['taps']}",
        f"- steps: {report['steps']} x batch {report['settings']['batch']}, "
        f"training-time test {report['settings']['ttt_steps']} steps",
        f"- held-out agreement per drafted position: {held['agreement_per_step']} "
        f"(predicted {held['predicted_tokens_per_pass']} tokens per target pass)",
        f"- measured (greedy, k = {measured['k']}): {measured['tokens_per_pass']} tokens per "
        f"target pass, acceptance {measured['acceptance_rate']}",
        f"- held-out answer tokens inside the draft vocabulary: "
        f"{report.get('held_out_coverage', '?')}", "",
        "Use: `mlxspec generate --draft PATH` (or `--draft auto` for the default model).", "",
        *_curve(report["log"]),
    ])


def _curve(log: list[dict]) -> list[str]:
    """The acceptance curve: held-out agreement per drafted position at every checkpoint."""
    rows = [e for e in log if "held_out" in e]
    if not rows:
        return []
    lines = ["## Acceptance against training", "",
             "| step | answer tokens trained on | held-out agreement (positions 1, 2, 3) "
             "| predicted tokens per pass |", "|--:|--:|--|--:|"]
    lines += [f"| {e['step']} | {e.get('tokens', '?')} | {e['held_out']} | "
              f"{expected_tokens_per_pass(e['held_out'])} |" for e in rows]
    return lines + [""]
