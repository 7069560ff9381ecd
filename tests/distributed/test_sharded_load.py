"""Each rank of a sharded target loads lazily and materializes only its own weights: a pipeline
rank of the default model (its 15 layers of 30, the embedding, the final norm) holds far fewer
weight bytes than one process, and its peak resident memory stays below one process's: the
other ranks' layers are never read."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ring import environment, ring

pytestmark = pytest.mark.slow
TIMEOUT = 240  # s for one two-rank load on a loaded 2-core host (about 10 s idle)

# Prints, after the load, the process's peak and current resident memory (VmHWM, VmRSS, from
# /proc) and MLX's active bytes (the evaluated arrays: the weights, here), in MiB, holding the
# model.
MEASURE = """
import gc, json, sys
import mlxspec
import mlx.core as mx
mode = sys.argv[1]
if mode == "one":
    from mlxspec.load import load
    model = load(None)
else:
    from mlxspec.distributed import barrier, load_sharded
    model = load_sharded(None, mode)
gc.collect()
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
got = {k: int(status[k].split()[0]) / 1024 for k in ("VmHWM", "VmRSS")}
got["active"] = mx.get_active_memory() / 2**20
sys.__stdout__.write(json.dumps(got) + "\\n")
sys.__stdout__.flush()
if mode != "one":
    barrier()
"""


def test_a_pipeline_rank_never_materializes_the_other_ranks_layers(tmp_path):
    one = subprocess.run([sys.executable, "-c", MEASURE, "one"], env=environment(),
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert one.returncode == 0, one.stderr
    whole = json.loads(one.stdout.splitlines()[-1])
    with ring(["pipeline"], tmp_path, program=(sys.executable, "-c", MEASURE)) as procs:
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    for out, _ in outs:
        rank = json.loads(out.splitlines()[-1])
        # Half the layers of 30 (about 63 of the 98 MB of weights: the embedding, which every
        # stage uses for its input and tied head, is whole on every rank)
        assert rank["active"] < 0.8 * whole["active"], (rank, whole)
        # Loading the whole model first, then dropping half of it, peaked above one process
        # (294 against 263 MiB; the ring adds its own): lazily, a rank peaks below it.
        assert rank["VmHWM"] < whole["VmHWM"] - 16, (rank, whole)
