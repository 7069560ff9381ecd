"""The group's report and the decisions every rank must share, in one process (a group of one:
rank 0's values are the values); two real ranks are test_sharded_generate.py's."""

from __future__ import annotations

import pytest

from mlxspec.distributed import SHARDED_DRAFT_TOKENS, agreed_decoding


def test_a_sharded_run_drafts_a_fixed_length_and_keeps_a_given_seed():
    assert agreed_decoding("auto", 1234) == (SHARDED_DRAFT_TOKENS, 1234)
    assert agreed_decoding(7, 0) == (7, 0)
    k, seed = agreed_decoding("auto", None)  # none given: rank 0 draws one for everybody
    assert k == SHARDED_DRAFT_TOKENS and 0 <= seed < 2**24


def test_doctor_says_one_process_without_a_launcher(monkeypatch):
    from mlxspec.system import _group

    for variable in ("MLX_HOSTFILE", "MLX_IBV_DEVICES", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    assert _group().startswith("one process") and "docs/distributed.md" in _group()


@pytest.mark.parametrize("value", ["auto", 3])
def test_a_draft_length_is_an_int_on_every_rank(value):
    k, _ = agreed_decoding(value, 5)
    assert isinstance(k, int) and k == (SHARDED_DRAFT_TOKENS if value == "auto" else value)
