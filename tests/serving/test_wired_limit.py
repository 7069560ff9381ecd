"""The process-wide wired-memory limit under several engines (``mlxspec.serving.wired``): set by
the first, restored by the last to the value from before the first, whatever the closing order.
A CPU build has no wired limit, so MLX's two calls are replaced by a recorder of one limit."""

from __future__ import annotations

import pytest

from mlxspec.serving import wired

RECOMMENDED, ORIGINAL = 48 << 30, 0


@pytest.fixture
def device(monkeypatch):
    """The limit as a Mac would hold it: mlx-lm's setter returns the old value, as MLX's does."""
    state = {"limit": ORIGINAL, "calls": 0}

    def set_limit(value):
        old, state["limit"] = state["limit"], value
        state["calls"] += 1
        return old

    monkeypatch.setattr(wired, "maybe_set_recommended_wired_limit", lambda: set_limit(RECOMMENDED))
    monkeypatch.setattr(wired.mx, "set_wired_limit", set_limit)
    monkeypatch.setattr(wired.mx, "synchronize", lambda *_: None)
    # Engines other tests of this process left open hold it too: this test counts its own.
    monkeypatch.setattr(wired, "_holders", 0)
    monkeypatch.setattr(wired, "_before", None)
    return state


@pytest.mark.parametrize("order", ["first opened closes first", "last opened closes first"])
def test_the_limit_stays_while_any_engine_runs_and_is_restored_after_the_last(device, order):
    wired.hold()
    wired.hold()
    assert device["limit"] == RECOMMENDED and device["calls"] == 1  # set once
    wired.release()
    assert device["limit"] == RECOMMENDED  # the other engine still runs with it
    wired.release()
    assert device["limit"] == ORIGINAL and wired.holders() == 0
    wired.release()  # a second close of the same engine changes nothing
    assert device["limit"] == ORIGINAL and device["calls"] == 2


def test_decode_batches_hold_and_release_the_limit(device):
    from llama_toys import tiny_llama

    from mlxspec.serving.decode_batch import DecodeBatch

    model = tiny_llama()
    first, second = (DecodeBatch(model, [0], max_batch=2, prefill_step=8) for _ in range(2))
    assert wired.holders() == 2 and device["limit"] == RECOMMENDED
    first.close()
    first.close()
    assert wired.holders() == 1 and device["limit"] == RECOMMENDED
    second.close()
    assert wired.holders() == 0 and device["limit"] == ORIGINAL
