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
from collections.abc import Callable
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


def _batch(samples: list[dict], index: list[int], to_draft: np.ndarray, steps: int):
    """Pad ``samples[index]`` at the end (causal: real positions never see the padding)."""
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
    return [mx.array(a) for a in (features, tokens, ids, probs, mask)]


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
) -> list[dict]:
    """Train ``head`` on ``samples`` (``features.load_shards``) up to ``settings.steps``,
    resuming from ``directory``'s checkpoint. Returns the log (step, loss, agreement per TTT
    step, seconds). ``should_stop()`` ends the run early (after a checkpoint)."""
    directory = Path(directory)
    to_draft = np.full(head.config.vocab_size, -1, np.int32)
    to_draft[np.array(head.draft_ids())] = np.arange(head.config.draft_vocab_size)
    if not settings.train_lm_head:
        head.lm_head.freeze()
    optimizer = optim.AdamW(learning_rate=_schedule(settings), weight_decay=0.0)
    step, log = load_checkpoint(directory, head, optimizer)
    order = np.random.default_rng(settings.seed)
    epochs = [order.permutation(len(samples)) for _ in range(
        math.ceil(settings.steps * settings.batch / max(len(samples), 1)) + 1)]
    stream = np.concatenate(epochs)
    loss_and_grad = nn.value_and_grad(head, lambda h, *a: ttt_loss(h, *a, settings.ttt_steps))
    tic, stopped = time.perf_counter(), False
    with progress_bar("training the draft head", settings.steps, show_progress) as advance:
        for _ in range(step):
            advance()
        while step < settings.steps and not stopped:
            index = stream[step * settings.batch : (step + 1) * settings.batch].tolist()
            (loss, agree), grads = loss_and_grad(head, *_batch(samples, index, to_draft,
                                                               settings.ttt_steps))
            grads, _ = optim.clip_grad_norm(grads, 1.0)
            optimizer.update(head, grads)
            mx.eval(head.parameters(), optimizer.state, loss, agree)
            step += 1
            advance()
            if step % 10 == 0 or step == settings.steps:
                log.append({"step": step, "loss": round(loss.item(), 4),
                            "agreement": [round(a, 3) for a in agree.tolist()],
                            "seconds": round(time.perf_counter() - tic, 1)})
            stopped = should_stop()
            if step % settings.every == 0 or step == settings.steps or stopped:
                save_checkpoint(directory, head, optimizer, step, settings, log)
    return log
