"""mlxspec.cpu.huge_pages: a model's weights moved onto 2 MB pages in place, bytes and outputs unchanged.

Where the kernel reports the pages (``/proc/self/smaps``) is the independent check that they
moved; numpy's view of each weight gives the addresses the stretches must cover.
"""

from __future__ import annotations

import ctypes
import mmap
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxspec.cpu import huge_pages


class TwoLayers(nn.Module):
    """Weights big enough to hold whole 2 MB pages (8 MB and 4 MB of float32)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(1024, 2048, bias=False)
        self.down = nn.Linear(2048, 512, bias=True)

    def __call__(self, x):
        return self.down(nn.gelu(self.up(x)))


def collapse_supported() -> str | None:
    """Why huge pages cannot move here (None: they can): THP off, or no MADV_COLLAPSE."""
    if not huge_pages.applies():
        return "huge pages do not apply here (not Linux, Metal, THP never, or switched off)"
    size = 4 * huge_pages.HUGE_PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.write(b"\1" * size)
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    first = -(-start // huge_pages.HUGE_PAGE) * huge_pages.HUGE_PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(first, huge_pages.HUGE_PAGE, huge_pages.MADV_HUGEPAGE)
    ok = libc.madvise(first, huge_pages.HUGE_PAGE, huge_pages.MADV_COLLAPSE) == 0
    region.close()
    return None if ok else "this kernel refuses MADV_COLLAPSE (Linux < 6.1 or THP restricted)"


def huge_kb_at(address: int) -> int:
    """AnonHugePages (kB) of the mapping holding ``address``, from /proc/self/smaps."""
    text = Path("/proc/self/smaps").read_text()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        low, high = (int(x, 16) for x in block.split(None, 1)[0].split("-"))
        if low <= address < high:
            return int(re.search(r"AnonHugePages:\s+(\d+)", block).group(1))
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_stretches_cover_every_weight():
    model = TwoLayers()
    mx.eval(model.parameters())
    stretches = huge_pages.weight_stretches(model)
    assert stretches == sorted(stretches)
    ends, starts = [b for _, b in stretches[:-1]], [a for a, _ in stretches[1:]]
    assert all(a < b for a, b in stretches) and all(e <= s for e, s in zip(ends, starts, strict=True))
    for weight in (model.up.weight, model.down.weight, model.down.bias):
        start = np.asarray(weight).ctypes.data  # numpy's own view of the same buffer
        assert any(a <= start and start + weight.nbytes <= b for a, b in stretches)


def test_a_strided_weight_is_left_out_and_loading_goes_on():
    # Some checkpoints hold views (a transposed tensor, a slice of a fused one): their memory
    # belongs to another array, so they are skipped, never an error during load.
    model = TwoLayers()
    model.up.weight = model.up.weight.T.T[:, ::2]
    mx.eval(model.parameters())
    strided = np.asarray(model.up.weight)
    stretches = huge_pages.weight_stretches(model)
    assert not strided.flags.c_contiguous
    bias = np.asarray(model.down.bias).ctypes.data
    assert any(a <= bias < b for a, b in stretches)


def test_weights_move_onto_huge_pages_with_the_same_bytes_and_outputs():
    why = collapse_supported()
    if why:
        pytest.skip(why)
    model = TwoLayers()
    mx.eval(model.parameters())
    x = mx.random.normal((3, 1024))
    before = np.array(model(x))
    weights = {name: np.array(w) for name, w in (("up", model.up.weight),
                                                 ("down", model.down.weight))}
    up_start = np.asarray(model.up.weight).ctypes.data
    assert huge_pages.back_weights(model, wait=True) is not None
    # The 8 MB weight holds at least three whole 2 MB pages: the kernel now maps them huge.
    assert huge_kb_at(up_start + 4 * 2**20) >= 2048
    assert np.asarray(model.up.weight).ctypes.data == up_start  # moved in place, not copied
    assert np.array_equal(np.array(model.up.weight), weights["up"])
    assert np.array_equal(np.array(model.down.weight), weights["down"])
    assert np.array_equal(np.array(model(x)), before)
    assert "MB of weights on 2 MB pages" in huge_pages.describe()


def test_switched_off_nothing_moves(monkeypatch):
    monkeypatch.setenv(huge_pages.SWITCH, "0")
    model = TwoLayers()
    mx.eval(model.parameters())
    assert not huge_pages.applies()
    assert huge_pages.back_weights(model) is None
    assert huge_pages.describe().startswith("off")
