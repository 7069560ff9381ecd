"""Linux, CPU-only MLX: a loaded model's weights moved onto 2 MB transparent huge pages, in place.

Decoding reads every weight once per token. On 4 KB pages, SmolLM2's 537 MB of float32 weights
span ~131,000 pages a step, and the TLB holds a few thousand: nearly every page costs a miss and a
page walk. MLX's CPU allocator takes each weight from ``malloc``, and glibc maps each large one on
its own, on 4 KB pages (unless the machine sets THP to "always"). After loading,
:func:`back_weights` asks the kernel to put the weights on huge pages where they are
(``madvise`` ``MADV_HUGEPAGE``, then ``MADV_COLLAPSE``, Linux >= 6.1): the same addresses and
bytes, so nothing in MLX changes and every output is the same. Only whole 2 MB-aligned stretches
can move (glibc places consecutive weights next to each other, so ~500 of SmolLM2's 537 MB do).

SmolLM2 on a 2-vCPU Xeon, mlxspec's engine, decode steps in separate processes in turns: 1 stream
35.1 -> 33.3 ms, 8 streams 48.9 -> 45.3 ms (``bench/huge_pages.py``,
``bench/results/huge_pages.json``). It runs on a background thread (the kernel
copies ~0.5 GB, 0.1-3 s depending on how fragmented free memory is), so ``load`` does not wait.

``MLXSPEC_HUGE_PAGES=0`` turns it off. Nothing happens where Metal is available (unified memory,
MLX's own allocator), off Linux, with THP set to "never", for lazily loaded weights, or where the
kernel lacks ``MADV_COLLAPSE`` (the hint alone then lets ``khugepaged`` do it over time).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxspec.switches import turned_off

SWITCH = "MLXSPEC_HUGE_PAGES"
HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KB base pages) transparent huge page
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # <asm-generic/mman-common.h>
# Weights closer than this are one stretch (glibc's headers and alignment leave small gaps; the
# gaps move to huge pages with them)
MAX_GAP = 1 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THREAD_NAME = "mlxspec-huge-pages"  # the background thread (a benchmark joins it before timing)

_state: dict[str, object] = {}  # "why" it does nothing here, "moved" bytes once a thread is done


def applies() -> bool:
    """Whether weights are moved here: Linux, no Metal, THP not off, not switched off."""
    if turned_off(SWITCH) or sys.platform != "linux" or mx.metal.is_available():
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def back_weights(model: nn.Module, *, wait: bool = False) -> threading.Thread | None:
    """Move ``model``'s (evaluated) weights onto huge pages, on a background thread.

    Returns the thread (``wait=True``: joined before returning), None where nothing is done
    (:func:`applies`). The bytes moved are in ``describe()`` afterwards.
    """
    if not applies():
        return None
    try:
        stretches = weight_stretches(model)
    except (TypeError, ValueError, BufferError) as e:  # a speed-up only: loading goes on
        _state["why"] = f"weights not moved: {e}"
        return None
    thread = threading.Thread(target=_advise, args=(stretches,), name=THREAD_NAME,
                              daemon=True)
    thread.start()
    if wait:
        thread.join()
    return thread


def weight_stretches(model: nn.Module) -> list[tuple[int, int]]:
    """The model's weights as address ranges ``[start, end)``, neighbours at most
    ``MAX_GAP`` apart merged; the 2 MB-aligned part of each is what can move."""
    ranges = []
    for _, weight in tree_flatten(model.parameters()):
        if not isinstance(weight, mx.array) or weight.nbytes == 0:
            continue
        with memoryview(weight) as view:  # the array's own buffer (no copy)
            if view.c_contiguous and not view.readonly:  # a strided view of another array is left out
                ranges.append((ctypes.addressof(ctypes.c_char.from_buffer(view)), weight.nbytes))
    merged: list[list[int]] = []
    for start, size in sorted(ranges):
        if merged and start - merged[-1][1] <= MAX_GAP:
            merged[-1][1] = max(merged[-1][1], start + size)
        else:
            merged.append([start, start + size])
    return [(start, end) for start, end in merged]


def _advise(stretches: list[tuple[int, int]]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    moved = 0
    for start, end in stretches:
        first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if last <= first:
            continue
        libc.madvise(first, last - first, MADV_HUGEPAGE)
        if libc.madvise(first, last - first, MADV_COLLAPSE) == 0:
            moved += last - first
    _state["moved"] = _state.get("moved", 0) + moved


def describe() -> str:
    """One line for ``mlxspec doctor``."""
    if not applies():
        return f"off ({SWITCH}=0, not Linux, Metal, or THP set to never)"
    moved = _state.get("moved")
    if moved is None:
        return f"on ({_state.get('why', 'no model moved yet')})"
    return f"on: {moved / 1e6:.0f} MB of weights on 2 MB pages; {SWITCH}=0 turns it off"
