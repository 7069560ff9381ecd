"""A prototype, measured: each layer's q/k/v projections as one product, and gate/up as one.

    python bench/fused_projections.py [--model DIR] [--rows 1,8] [--rounds 4] [--steps 64] [--out F]

mlx-lm's llama-family blocks multiply x by q_proj, k_proj and v_proj in turn (three products,
two of 192 x 576 for SmolLM2) and by gate_proj and up_proj in turn: 7 products a layer. Here
(not in mlxspec: a module swap for the benchmark only) the weights of each group are concatenated
and multiplied once, each projection returning its columns of that product: 4 products a layer,
211 -> 121 a token. The BLAS shim computes every output the same way whatever the product's
width, so the logits are bitwise the same (checked on a prompt, ``same_logits``).

The same runs as bench/huge_pages.py (a fresh process per run, ``rows`` greedy streams, the median
of ``--steps`` engine steps once all decode, the variants in turns); both variants have their
weights on huge pages (the concatenated ones are moved there after the swap) and run on mimalloc,
as the ``mlxspec`` command runs. JSON on stdout.
"""

from __future__ import annotations

from huge_pages import report, side_by_side, step_options

from mlxspec.cpu import allocator

# Run by bench/huge_pages.py's child before timing (MLXSPEC_BENCH_PREPARE): the swap.
PREPARE = """
import os
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlxspec.cpu import huge_pages


class Part(nn.Module):
    '''Columns [start, stop) of the group's product, computed once per input array.'''

    def __init__(self, group, start, stop, weight=None):
        super().__init__()
        self._group, self._start, self._stop = group, start, stop
        if weight is not None:
            self.weight = weight  # in the tree: moved to huge pages with the others

    def __call__(self, x):
        g = self._group
        if g["x"] is not x:
            g["x"], g["out"] = x, x @ g["weight"].T
        return g["out"][..., self._start : self._stop]


def fuse(parent, names):
    linears = [parent[n] for n in names]
    weight = mx.concatenate([m.weight for m in linears])
    mx.eval(weight)
    # huge_pages moves weights where they are: the group's array stays the one in the tree
    group, start = {"x": None, "out": None, "weight": weight}, 0
    for i, (name, m) in enumerate(zip(names, linears)):
        stop = start + m.weight.shape[0]
        parent[name] = Part(group, start, stop, weight if i == 0 else None)
        start = stop


def prepare(model, tokenizer):
    prompt = mx.array(tokenizer.encode("The history of clocks begins"))[None]
    before = np.array(model(prompt))
    if os.environ.get("FUSED_PROJECTIONS") == "1":
        for layer in model.model.layers:
            fuse(layer.self_attn, ["q_proj", "k_proj", "v_proj"])
            fuse(layer.mlp, ["gate_proj", "up_proj"])
        thread = huge_pages.back_weights(model)
        if thread is not None:
            thread.join()
    return {"same_logits": bool(np.array_equal(before, np.array(model(prompt))))}
"""


@step_options
def main(model: str | None, rows: str, rounds: int, steps: int, out: str | None) -> None:
    library = allocator.library_path()  # the allocator the mlxspec command runs on
    common = {"MLXSPEC_BENCH_PREPARE": PREPARE, "LD_PRELOAD": str(library) if library else ""}
    variants = {"separate": {**common, "FUSED_PROJECTIONS": "0"},
                "fused": {**common, "FUSED_PROJECTIONS": "1"}}
    counts = [int(r) for r in rows.split(",")]
    result = side_by_side(variants, counts, rounds, steps, model)
    result["note"] = "prototype module swap, not part of mlxspec"
    report(result, out)


if __name__ == "__main__":
    main()
