"""The training loop: batches of samples, AdamW on the head, checkpoints that resume exactly.

A checkpoint (``checkpoint/``: the head's weights, the optimizer's state, the step and the data
order's seed) is written every ``every`` steps to a temporary directory and renamed over the
last one, so a kill at any moment leaves the previous checkpoint whole; a rerun continues from
it with the same batches it would have seen.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlxspec.draft_training.recipe import ttt_loss
from mlxspec.errors import CorruptModelError
from mlxspec.progress import progress_bar
from mlxspec.speculative.eagle3 import Eagle3Head

CHECKPOINT = "checkpoint"
BUCKET = 16  # batches whose samples are sorted by length together (less padding)


@dataclass
class TrainSettings:
    """Steps, batch (sequences), TTT steps, learning rate (peak, cosine after a warm-up)."""

    steps: int = 2000
    batch: int = 4
    ttt_steps: int = 3
    lr: float = 6e-4
    warmup: int = 50
    every: int = 100  # steps between checkpoints
    seed: int = 0
    # The LM head starts as the target's own rows (recipe.new_head): kept frozen, the head learns
    # to produce the target's last hidden state, with fewer weights to fit on little data.
    train_lm_head: bool = False
    # fc is trained on features divided by their per-dimension RMS (``feature_scale``) and
    # folded back (W = W' / s) in every checkpoint and at the end: the same function, but the
    # target's outlier dimensions (|x| in the hundreds, a few in the tens of thousands) no
    # longer take Adam's equal-sized steps at their own huge scale.
    scale_features: bool = True


def feature_scale(samples: list[dict]) -> np.ndarray:
    """(width,) float32 RMS of each feature dimension over the answer positions (the prompt's
    first positions, attention sinks of enormous norm, left out)."""
    total, count = None, 0
    for s in samples:
        x = s["features"][max(int(s["prompt"]) - 1, 0) :].astype(np.float64)
        total = (x * x).sum(0) if total is None else total + (x * x).sum(0)
        count += x.shape[0]
    return np.maximum(np.sqrt(total / max(count, 1)), 1e-3).astype(np.float32)


@contextmanager
def _folded(head: Eagle3Head, scale: mx.array | None) -> Iterator[None]:
    """The head in its published parametrization (fc reads raw features) within the block."""
    if scale is None:
        yield
        return
    trained = head.fc.weight
    head.fc.weight = trained / scale
    try:
        yield
    finally:
        head.fc.weight = trained


def _pass_through(weight: mx.array, scale: np.ndarray) -> mx.array:
    """A fresh fc (H, 3H) in the scaled parametrization, plus a pass-through of the highest tap
    normalized to unit RMS: the head starts from the target's late hidden state (a strong,
    informative residual path; with small random features alone it collapsed to predicting one
    token everywhere) and learns the step to the next token from there."""
    hidden = weight.shape[0]
    high = scale[-hidden:]
    block = np.diag(high / np.sqrt(np.mean(high * high))).astype(np.float32)
    return weight + mx.concatenate([mx.zeros((hidden, weight.shape[1] - hidden)),
                                    mx.array(block)], axis=1)


def _batch(samples: list[dict], index: list[int], to_draft: np.ndarray, steps: int,
           scale: np.ndarray | None = None):
    """Pad ``samples[index]`` at the end (causal: real positions never see the padding);
    features divided by ``scale`` when given."""
    T = max(len(samples[i]["tokens"]) for i in index) - 1
    width = samples[index[0]]["features"].shape[1]
    K = samples[index[0]]["top_ids"].shape[1]
    B, span = len(index), T + steps
    features = np.zeros((B, T, width), np.float16)
    tokens = np.zeros((B, span - 1), np.int32)
    ids = np.full((B, span, K), -1, np.int32)
    probs = np.zeros((B, span, K), np.float32)
    mask = np.zeros((B, span), np.float32)
    for b, i in enumerate(index):
        s, n = samples[i], len(samples[i]["tokens"])
        features[b, : n - 1] = s["features"][: n - 1]
        tokens[b, : n - 1] = s["tokens"][1:]
        draft = to_draft[s["top_ids"]]
        p = np.where(draft >= 0, s["top_probs"].astype(np.float32), 0.0)
        ids[b, :n], probs[b, :n] = draft, p / np.maximum(p.sum(-1, keepdims=True), 1e-9)
        mask[b, max(int(s["prompt"]) - 1, 0) : n - 1] = 1.0  # positions whose next token answers
    if scale is not None:
        features = features.astype(np.float32) / scale
    return [mx.array(a) for a in (features, tokens, ids, probs, mask)]


def _data_order(samples: list[dict], settings: TrainSettings) -> np.ndarray:
    """The sample index of every batch slot, epoch after epoch (a function of the seed only, so
    a resumed run sees the batches it would have seen). Each epoch is shuffled, then every
    window of BUCKET batches is sorted by length and its batches shuffled again: a batch's
    answers are of similar lengths, so little of it is padding."""
    rng = np.random.default_rng(settings.seed)
    lengths = np.array([len(s["tokens"]) for s in samples])
    window = BUCKET * settings.batch
    order = []
    for _ in range(math.ceil(settings.steps * settings.batch / max(len(samples), 1)) + 1):
        epoch = rng.permutation(len(samples))
        for lo in range(0, len(epoch), window):
            part = epoch[lo : lo + window]
            part = part[np.argsort(lengths[part], kind="stable")]
            batches = [part[i : i + settings.batch] for i in range(0, len(part), settings.batch)]
            order += [batches[i] for i in rng.permutation(len(batches))]
    return np.concatenate(order)


def _schedule(settings: TrainSettings) -> Callable:
    warm = optim.linear_schedule(settings.lr * 0.05, settings.lr, max(settings.warmup, 1))
    decay = optim.cosine_decay(settings.lr, max(settings.steps - settings.warmup, 1),
                               settings.lr * 0.1)
    return optim.join_schedules([warm, decay], [max(settings.warmup, 1)])


def save_checkpoint(directory: Path, head: Eagle3Head, optimizer: optim.Optimizer, step: int,
                    settings: TrainSettings, log: list[dict]) -> None:
    """Write the checkpoint next to the old one, then swap it in."""
    temporary = directory / f"{CHECKPOINT}.partial"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    mx.save_safetensors(str(temporary / "head.safetensors"), dict(tree_flatten(head.parameters())))
    mx.save_safetensors(str(temporary / "optimizer.safetensors"),
                        dict(tree_flatten(optimizer.state)))
    (temporary / "state.json").write_text(json.dumps(
        {"step": step, "settings": asdict(settings), "log": log}))
    final, old = directory / CHECKPOINT, directory / f"{CHECKPOINT}.old"
    if final.exists():
        os.replace(final, old)
    os.replace(temporary, final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(directory: Path, head: Eagle3Head, optimizer: optim.Optimizer):
    """(step, log) of the checkpoint in ``directory`` (loaded into head and optimizer), or
    (0, []) when there is none. Raises CorruptModelError for a damaged one."""
    final = directory / CHECKPOINT
    if not final.exists() and (directory / f"{CHECKPOINT}.old").exists():
        final = directory / f"{CHECKPOINT}.old"  # killed between the two renames
    if not final.exists():
        return 0, []
    try:
        state = json.loads((final / "state.json").read_text())
        head.load_weights(list(mx.load(str(final / "head.safetensors")).items()))
        optimizer.state = tree_unflatten(list(mx.load(str(final / "optimizer.safetensors")).items()))
    except Exception as e:
        raise CorruptModelError(
            f"the training checkpoint {final} is damaged ({str(e).splitlines()[0]}): delete it "
            "to train from the start") from e
    return int(state["step"]), list(state["log"])


def train(
    head: Eagle3Head, samples: list[dict], directory: Path, settings: TrainSettings,
    show_progress: bool = True, should_stop: Callable[[], bool] = lambda: False,
    evaluate: Callable[[Eagle3Head], list[float]] | None = None,
) -> list[dict]:
    """Train ``head`` on ``samples`` (``features.load_shards``) up to ``settings.steps``,
    resuming from ``directory``'s checkpoint.

    Returns the log: every 10 steps the step, the answer tokens trained on so far, the loss,
    the batch's agreement per TTT step and the seconds; at every checkpoint also
    ``held_out``: ``evaluate(head)`` (the held-out agreement per TTT step, the acceptance curve
    against steps and tokens). ``should_stop()`` ends the run early (after a checkpoint)."""
    directory = Path(directory)
    to_draft = np.full(head.config.vocab_size, -1, np.int32)
    to_draft[np.array(head.draft_ids())] = np.arange(head.config.draft_vocab_size)
    if not settings.train_lm_head:
        head.lm_head.freeze()
    optimizer = optim.AdamW(learning_rate=_schedule(settings), weight_decay=0.0)
    step, log = load_checkpoint(directory, head, optimizer)  # checkpoints hold the folded fc
    scale = feature_scale(samples) if settings.scale_features else None
    fold = None if scale is None else mx.array(scale)
    if fold is not None and step > 0:  # a fresh head's fc initialises W' itself
        head.fc.weight = head.fc.weight * fold  # W' = W * s: fc(x) = W' (x / s)
    elif fold is not None:
        head.fc.weight = _pass_through(head.fc.weight, scale)
    stream = _data_order(samples, settings)
    loss_and_grad = nn.value_and_grad(head, lambda h, *a: ttt_loss(h, *a, settings.ttt_steps))
    tic, stopped = time.perf_counter(), False
    seconds = log[-1]["seconds"] if log else 0.0  # a resumed run's clock continues
    tokens = log[-1].get("tokens", 0) if log else 0
    with progress_bar("training the draft head", settings.steps, show_progress) as advance:
        for _ in range(step):
            advance()
        while step < settings.steps and not stopped:
            index = stream[step * settings.batch : (step + 1) * settings.batch].tolist()
            batch = _batch(samples, index, to_draft, settings.ttt_steps, scale)
            (loss, agree), grads = loss_and_grad(head, *batch)
            grads, _ = optim.clip_grad_norm(grads, 1.0)
            optimizer.update(head, grads)
            mx.eval(head.parameters(), optimizer.state, loss, agree)
            step += 1
            tokens += int(batch[-1].sum().item())  # answer positions trained on
            advance()
            stopped = should_stop()
            checkpoint = step % settings.every == 0 or step == settings.steps or stopped
            if step % 10 == 0 or checkpoint:
                entry = {"step": step, "tokens": tokens, "loss": round(loss.item(), 4),
                         "agreement": [round(a, 3) for a in agree.tolist()],
                         "seconds": round(seconds + time.perf_counter() - tic, 1)}
                if checkpoint and evaluate is not None:
                    with _folded(head, fold):
                        entry["held_out"] = evaluate(head)
                if not log or log[-1]["step"] != step:
                    log.append(entry)
            if checkpoint:
                with _folded(head, fold):
                    save_checkpoint(directory, head, optimizer, step, settings, log)
    if fold is not None:
        head.fc.weight = head.fc.weight / fold
    return log
