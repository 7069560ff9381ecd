"""Training a feature draft: a tiny run to a head that loads back, exact resume, nothing lost,
the acceptance curve logged.

The tiny runs use a 4-layer random model with a byte tokenizer (tests/tiny_models.py): the
head's quality is not the point (that is the benchmark's), the flow's guarantees are.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from llama_toys import tiny_llama
from mlx.utils import tree_flatten
from speculative_helpers import plain_tokens, spec_tokens
from tiny_models import make_tiny_model

from mlxspec.draft_training.data import SAMPLES, generate_samples, read_samples
from mlxspec.draft_training.flow import train_draft
from mlxspec.draft_training.recipe import new_head
from mlxspec.draft_training.train import CHECKPOINT, TrainSettings, train
from mlxspec.errors import CorruptModelError, OutputExistsError
from mlxspec.load import load
from mlxspec.speculative.eagle3 import load_head
from mlxspec.speculative.feature import FeatureDrafter


def _synthetic_samples(n: int, width: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        length = int(rng.integers(6, 12))
        ids = rng.integers(0, vocab, (length, 8)).astype(np.int32)
        probs = rng.dirichlet(np.ones(8), length).astype(np.float16)
        samples.append({"features": rng.standard_normal((length, width)).astype(np.float16),
                        "top_ids": ids, "top_probs": probs,
                        "tokens": rng.integers(0, vocab, length).astype(np.int32),
                        "prompt": np.array(2, np.int32)})
    return samples


def _fresh_head(model, draft_ids):
    mx.random.seed(7)  # the same initial weights every time (as a rerun of the same command)
    return new_head(model, draft_ids, {})


def _weights(head) -> dict:
    return {k: np.array(v) for k, v in tree_flatten(head.parameters())}


def test_an_interrupted_training_run_resumes_to_the_same_weights(tmp_path):
    model = tiny_llama(0, layers=4, vocab=64, hidden=32)
    samples = _synthetic_samples(10, 3 * 32, 64)
    settings = TrainSettings(steps=6, batch=2, every=100, warmup=2)
    straight = _fresh_head(model, list(range(0, 64, 2)))
    train(straight, samples, tmp_path / "straight", settings, show_progress=False)

    stops = iter([False, False, True])  # stopped after step 3 (as a kill after a checkpoint)
    first = _fresh_head(model, list(range(0, 64, 2)))
    train(first, samples, tmp_path / "resumed", settings, show_progress=False,
          should_stop=lambda: next(stops, False))
    state = json.loads((tmp_path / "resumed" / CHECKPOINT / "state.json").read_text())
    assert state["step"] == 3
    resumed = new_head(model, list(range(0, 64, 2)), {})  # another start: the checkpoint wins
    train(resumed, samples, tmp_path / "resumed", settings, show_progress=False)
    for name, value in _weights(straight).items():
        np.testing.assert_allclose(_weights(resumed)[name], value, rtol=1e-5, atol=1e-6)
    assert not np.allclose(_weights(resumed)["fc.weight"],
                           _weights(_fresh_head(model, list(range(0, 64, 2))))["fc.weight"])


def test_a_damaged_checkpoint_is_one_error_line(tmp_path):
    model = tiny_llama(0, layers=4, vocab=64, hidden=32)
    samples = _synthetic_samples(4, 96, 64)
    settings = TrainSettings(steps=2, batch=2, warmup=1)
    train(new_head(model, list(range(32)), {}), samples, tmp_path, settings, show_progress=False)
    (tmp_path / CHECKPOINT / "head.safetensors").write_bytes(b"\0" * 10)
    with pytest.raises(CorruptModelError) as caught:
        train(new_head(model, list(range(32)), {}), samples, tmp_path, settings,
              show_progress=False)
    assert "\n" not in str(caught.value) and "delete it" in str(caught.value)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target") / "model", num_hidden_layers=4)


def test_a_cut_answer_file_keeps_the_finished_answers_and_redoes_the_rest(tmp_path, tiny_target):
    model, tokenizer = load(str(tiny_target))
    items = ["Say hi.", "Count to three.", "Name a colour."]
    generate_samples(model, tokenizer, items[:2], tmp_path, max_tokens=8, batch_size=2,
                     show_progress=False)
    lines = (tmp_path / SAMPLES).read_text().splitlines()
    (tmp_path / SAMPLES).write_text(lines[0] + "\n" + lines[1][:15])  # killed mid-line
    assert [s["id"] for s in read_samples(tmp_path)] == [0]
    samples = generate_samples(model, tokenizer, items, tmp_path, max_tokens=8, batch_size=2,
                               show_progress=False)
    assert [s["id"] for s in samples] == [0, 1, 2]
    assert json.dumps(samples[0]) == lines[0]  # the finished answer is kept as it was


def test_train_draft_writes_a_head_that_loads_back_and_drafts_losslessly(tmp_path, tiny_target):
    out = tmp_path / "head"
    report = train_draft(str(tiny_target), out, settings=TrainSettings(steps=4, batch=2, every=2),
                         max_tokens=12, limit=3, held_out_count=2, draft_vocab=64, batch_size=3,
                         show_progress=False)
    assert report["steps"] == 4 and report["held_out"]["measured"]["generated"] > 0
    curve = [e for e in report["log"] if "held_out" in e]  # a checkpoint every 2 steps
    assert [e["step"] for e in curve] == [2, 4] and curve[0]["tokens"] < curve[1]["tokens"]
    assert all(len(e["held_out"]) == 3 and 0 <= min(e["held_out"]) for e in curve)
    assert "| 4 |" in (out / "README.md").read_text()  # the curve on the card
    assert {"config.json", "model.safetensors", "README.md", "training.json"} <= \
        {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    model, tokenizer = load(str(tiny_target))
    head = load_head(out, model, tokenizer)
    drafter = FeatureDrafter(head, model, vocab_size=260)
    prompt = tokenizer.encode("Hello there")
    assert spec_tokens(model, drafter, prompt, 40, k=3) == plain_tokens(model, prompt, 40)
    # Rerunning finds everything done: no new answers, no new steps, the same head.
    before = (out / "model.safetensors").read_bytes()
    again = train_draft(str(tiny_target), out, settings=TrainSettings(steps=4, batch=2, every=2),
                        max_tokens=12, limit=3, held_out_count=2, draft_vocab=64, batch_size=3,
                        show_progress=False)
    assert again["steps"] == 4 and (out / "model.safetensors").read_bytes() == before


def test_an_output_directory_that_is_not_a_head_is_refused(tmp_path, tiny_target):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(OutputExistsError):
        train_draft(str(tiny_target), out, limit=1, show_progress=False)
    assert (out / "notes.txt").read_text() == "keep me"
    assert mx.array(0).item() == 0


def test_every_epoch_holds_each_answer_once_in_batches_of_similar_length():
    from mlxspec.draft_training.train import _data_order

    rng = np.random.default_rng(0)
    samples = [{"tokens": np.zeros(int(n))} for n in rng.integers(5, 500, 64)]
    order = _data_order(samples, TrainSettings(steps=64, batch=4))
    assert sorted(order[:64].tolist()) == list(range(64))  # one epoch: each sample once
    lengths = np.array([len(s["tokens"]) for s in samples])[order[:64]].reshape(16, 4)
    spread = (lengths.max(1) - lengths.min(1)).mean()
    shuffled = lengths.reshape(-1)[rng.permutation(64)].reshape(16, 4)
    assert spread < 0.5 * (shuffled.max(1) - shuffled.min(1)).mean()  # less padding
