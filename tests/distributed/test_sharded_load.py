"""Each rank of a sharded target loads lazily and materializes only its own weights: a pipeline
rank of the default model (its 15 layers of 30, the embedding, the final norm) holds far fewer
weight bytes than one process, and its peak resident memory stays below one process's: the
other ranks' layers are never read. An mlxspec-quantized model (MLX affine layout, integer
zero-points) tensor shards and decodes as one process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ring import environment, json_of, one_process, ring

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


def test_an_mlxspec_quantized_model_tensor_shards_and_decodes_as_one_process(
        tmp_path, smollm2_q8_dirs):
    # Its MLX affine biases hold integer zero-points, which mlxspec.load turns into zero-point
    # layers; MLX's shard_linear cannot split those ("no parameter named zeros"), so a sharded
    # load recovers them after sharding, for the layers left whole.
    args = ["generate", "-m", str(smollm2_q8_dirs["mlx"]), "-p", "Name three colors.",
            "--temp", "0", "--max-tokens", "6", "--draft", "none", "--json"]
    want = one_process(args)
    assert want.returncode == 0, want.stderr
    with ring([*args, "--shard", "tensor"], tmp_path) as (rank0, rank1):
        out, err = rank0.communicate(timeout=TIMEOUT)
        rank1.communicate(timeout=30)
    assert rank0.returncode == 0 and rank1.returncode == 0, err
    assert json_of(out)["text"] == json_of(want.stdout)["text"]
