"""The group's report and the decisions every rank must share, in one process (a group of one:
rank 0's values are the values); two real ranks are test_sharded_generate.py's."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlxspec.distributed import agreed_decoding


def test_a_sharded_run_keeps_auto_draft_lengths_and_a_given_seed():
    # "auto" stays: rank 0 chooses each pass's length for every rank (test_shared_drafting.py)
    assert agreed_decoding("auto", 1234) == ("auto", 1234)
    assert agreed_decoding(7, 0) == (7, 0)
    k, seed = agreed_decoding("auto", None)  # none given: rank 0 draws one for everybody
    assert k == "auto" and 0 <= seed < 2**24


def test_doctor_says_one_process_without_a_launcher(monkeypatch):
    from mlxspec.system import _group

    for variable in ("MLX_HOSTFILE", "MLX_IBV_DEVICES", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    assert _group().startswith("one process") and "docs/distributed.md" in _group()


@pytest.mark.parametrize("value", ["3", 3])
def test_a_fixed_draft_length_is_an_int_on_every_rank(value):
    k, _ = agreed_decoding(value, 5)
    assert isinstance(k, int) and k == 3


WEDGED = """
import re, sys, time
import mlxspec
from mlxspec.distributed.group import Watchdog
watchdog = Watchdog(timeout_s=0.5)
watchdog.backstop_s = 1.0
with watchdog:
    if sys.argv[1] == "wedged":  # the Python thread stuck in one call holding the GIL
        re.match(r"(a*)*b", "a" * 64)
    else:  # beats keep it alive; after the block nothing fires
        for _ in range(10):
            time.sleep(0.1)
            watchdog.beat()
time.sleep(3)  # past the deadline the last beat set, and the C thread's 1 s check
print("done")
"""


@pytest.mark.parametrize("case", ["wedged", "beating"])
def test_the_watchdog_ends_a_process_whose_python_thread_holds_the_gil(case):
    """A peer's death can leave rank 0 blocked in a call that holds the GIL, where the watchdog's
    own thread never runs: the shim's C thread ends the process backstop_s later, with the
    one error line. Beats and the end of the block disarm it."""
    from mlxspec.cpu import blas

    if not blas.deadline(0):
        pytest.skip("no BLAS shim here (its C thread is the backstop)")
    done = subprocess.run([sys.executable, "-c", WEDGED, case],
                          capture_output=True, text=True, timeout=60)
    if case == "wedged":
        assert done.returncode == 2, done.stderr
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "stopped answering" in errors[0], done.stderr
        assert "Traceback" not in done.stderr
    else:
        assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr
