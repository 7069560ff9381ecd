"""KV caches: the one cache builder, a sliding-window cache that rolls back, chunked prefill.

``make_cache`` is the only place mlxspec builds a prompt cache (target, draft and chat alike):
with ``max_kv_size`` every full-attention layer is bounded, whatever the model's ``make_cache``.
``prefill`` runs a prompt into a cache in chunks; ``trim_cache``/``cache_offset`` roll back and
count; a quantized KV cache is mlx-lm's (``maybe_quantize_kv_cache``).

The sliding window: 
mlx-lm's ``RotatingKVCache`` gives each one-token decoding step the first ``keep`` tokens plus the
latest ``max_size - keep`` tokens. Fed several tokens at once it concatenates instead, and its mask
then drops the ``keep`` tokens for all but the first query; once it has wrapped it cannot be
trimmed. Speculative verification needs both: one forward over ``[last, d1..dk]`` that gives every
position exactly the window a one-token step would, and a rollback of the rejected drafts.

``WindowKVCache`` stores the tokens in temporal order and keeps ``slack`` extra old tokens, so each
query gets its own window through an explicit mask and the last ``slack`` tokens can be trimmed.
It converts from and back to a ``RotatingKVCache`` (``from_rotating`` / ``to_rotating``), so callers
keep seeing mlx-lm's cache type between generations.

Layout: columns ``0 .. keep-1`` hold positions ``0 .. keep-1``; column ``c >= keep`` holds position
``c + dropped`` (the ``dropped`` positions after the kept ones were compacted away).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    KVCache,
    RotatingKVCache,
    _BaseCache,
    make_prompt_cache,
)

ROLLBACK_SLACK = 32  # tokens a sliding-window cache keeps beyond its window (> the longest draft)


class WindowKVCache(_BaseCache):
    """See the module docstring. ``offset`` is the number of tokens seen (RoPE position)."""

    step = 256

    def __init__(self, max_size: int, keep: int = 0, slack: int = 32):
        self.max_size = max_size  # one-token steps see keep + (max_size - keep) tokens
        self.keep = keep
        self.slack = slack  # tokens that can always be trimmed
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.dropped = 0

    # -- layout ------------------------------------------------------------------------------

    def _columns(self) -> int:
        return self.offset - self.dropped

    def _dropped_after_room_for(self, n: int) -> int:
        """``dropped`` once room is made for ``n`` new tokens (pure: masks and updates agree)."""
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if self._columns() + n <= capacity:
            return self.dropped
        # Oldest position a query can still need, even after rolling back ``slack`` tokens.
        oldest_needed = self.offset - self.slack - (self.max_size - self.keep) + 1
        return max(self.dropped, oldest_needed - self.keep)

    def _make_room(self, n: int, like: mx.array, like_values: mx.array) -> None:
        """Compact away unneeded old tokens and grow the buffers so ``n`` more tokens fit."""
        dropped = self._dropped_after_room_for(n)
        if (
            self.keys is not None
            and dropped == self.dropped
            and self._columns() + n <= self.keys.shape[2]
        ):
            return
        shift = dropped - self.dropped
        columns = self._columns() - shift
        capacity = columns + n + self.step
        B, H, _, Dk = like.shape
        new_keys = mx.zeros((B, H, capacity, Dk), like.dtype)
        new_values = mx.zeros((B, H, capacity, like_values.shape[3]), like_values.dtype)
        if self.keys is not None and columns > 0:
            # Keep the first `keep` columns and the columns after the compacted-away ones.
            kept = min(self.keep, columns)
            new_keys[..., :kept, :] = self.keys[..., :kept, :]
            new_values[..., :kept, :] = self.values[..., :kept, :]
            new_keys[..., kept:columns, :] = self.keys[..., kept + shift : columns + shift, :]
            new_values[..., kept:columns, :] = self.values[..., kept + shift : columns + shift, :]
        self.keys, self.values, self.dropped = new_keys, new_values, dropped

    # -- the mlx-lm cache protocol -------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append (B, heads, n, head_dim) keys/values; returns all stored ones in temporal order."""
        n = keys.shape[2]
        self._make_room(n, keys, values)
        start = self._columns()
        self.keys[..., start : start + n, :] = keys
        self.values[..., start : start + n, :] = values
        self.offset += n
        return self.keys[..., : start + n, :], self.values[..., : start + n, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """(N, columns) bool mask for the next N queries (computed before ``update_and_fetch``).

        Query at position t sees position s iff s <= t and (s < keep or s > t - (max_size - keep))
        and, when the model has a sliding window, s > t - window_size.
        """
        dropped = self._dropped_after_room_for(N)
        columns = self.offset - dropped + N
        col = mx.arange(columns)
        position = mx.where(col < self.keep, col, col + dropped)[None]  # (1, columns)
        query = mx.arange(self.offset, self.offset + N)[:, None]  # (N, 1)
        visible = position <= query
        visible &= (position < self.keep) | (position > query - (self.max_size - self.keep))
        if window_size is not None:
            visible &= position > query - window_size
        return visible

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self):
        columns = self._columns()
        return self.keys[..., :columns, :], self.values[..., :columns, :]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def trimmable(self) -> int:
        """How many of the latest tokens ``trim`` can remove exactly."""
        if self.dropped == 0:
            return self.offset
        # After trimming n, the query at offset - n must still find all of its window.
        oldest_kept = self.keep + self.dropped
        return max(0, self.offset - (self.max_size - self.keep) + 1 - oldest_kept)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the latest ``n`` tokens (at most ``trimmable()``); returns how many."""
        n = min(n, self.trimmable())
        self.offset -= n
        return n

    # -- conversion ------------------------------------------------------------------------------

    @classmethod
    def from_rotating(cls, cache: RotatingKVCache, slack: int = 32) -> WindowKVCache:
        """A ``WindowKVCache`` holding what ``cache`` holds, with the same window."""
        keys, values, offset, keep, max_size, idx = cache.state
        window = cls(max_size, keep, slack)
        window.offset = offset
        if keys is None:
            return window
        keys, values = _temporal(keys, keep, idx, offset), _temporal(values, keep, idx, offset)
        window.keys, window.values = keys, values
        window.dropped = offset - keys.shape[2]
        return window

    def to_rotating(self, cache: RotatingKVCache) -> None:
        """Put this cache's contents into ``cache`` in the state a one-token step would leave."""
        if self.keys is None:
            cache.state = (None, None, 0, self.keep, self.max_size, 0)
            return
        columns = self._columns()
        # The first `keep` tokens and the latest max_size - keep ones, in temporal order.
        recent = min(columns, self.max_size) - min(self.keep, columns)
        first = min(self.keep, columns)
        keys = mx.concatenate(
            [self.keys[..., :first, :], self.keys[..., columns - recent : columns, :]], axis=2
        )
        values = mx.concatenate(
            [self.values[..., :first, :], self.values[..., columns - recent : columns, :]], axis=2
        )
        cache.state = (keys, values, self.offset, self.keep, self.max_size, keys.shape[2])


def _temporal(v: mx.array, keep: int, idx: int, offset: int) -> mx.array:
    """A RotatingKVCache buffer (B, heads, slots, dim) in temporal order (mlx-lm's layout)."""
    if idx == v.shape[2]:
        return v
    if idx < offset:  # wrapped: [kept | oldest from idx on | newest before idx]
        return mx.concatenate([v[..., :keep, :], v[..., idx:, :], v[..., keep:idx, :]], axis=2)
    return v[..., :idx, :]


def cannot_roll_back(cache: list) -> str | None:
    """Why this prompt cache cannot drop rejected tokens exactly, or None if it can."""
    bad = sorted(
        {
            type(c).__name__
            for c in cache
            if not isinstance(c, (RotatingKVCache, WindowKVCache)) and not c.is_trimmable()
        }
    )
    return f"KV cache ({', '.join(bad)}) cannot roll back rejected tokens" if bad else None


def make_cache(model: nn.Module, max_kv_size: int | None = None) -> list:
    """The model's prompt cache, one entry per layer; the only cache builder of mlxspec.

    Args:
        max_kv_size: bound every full-attention layer to this many tokens: each plain ``KVCache``
            becomes ``RotatingKVCache(max_kv_size, keep=4)``, as mlx-lm does for models without
            their own ``make_cache`` (mlx-lm's ``make_prompt_cache`` ignores ``max_kv_size`` for
            llama and every model that defines ``make_cache``).
    """
    cache = make_prompt_cache(model)
    if max_kv_size is None:
        return cache
    return [
        RotatingKVCache(max_size=max_kv_size, keep=4) if type(c) is KVCache else c for c in cache
    ]


def swap_in_window_caches(cache: list, slack: int = ROLLBACK_SLACK) -> dict[int, RotatingKVCache]:
    """Replace each ``RotatingKVCache`` in ``cache`` (in place) by a ``WindowKVCache`` that can
    roll back ``slack`` tokens; returns the originals for ``swap_back``."""
    originals = {i: c for i, c in enumerate(cache) if isinstance(c, RotatingKVCache)}
    for i, rotating in originals.items():
        cache[i] = WindowKVCache.from_rotating(rotating, slack=slack)
    return originals


def swap_back(cache: list, originals: dict[int, RotatingKVCache]) -> None:
    """Undo ``swap_in_window_caches``: the caller sees mlx-lm's cache types again."""
    for i, rotating in originals.items():
        cache[i].to_rotating(rotating)
        cache[i] = rotating


def cache_offset(cache: list) -> int:
    """How many tokens the cache has seen (the first layer's offset)."""
    return int(getattr(cache[0], "offset", 0)) if cache else 0


def trim_cache(cache: list, n: int) -> bool:
    """Drop the latest ``n`` tokens from every layer; False (cache unchanged in count) if any
    layer cannot (a wrapped rotating cache), so the caller can rebuild it."""
    if n <= 0:
        return True
    if not all(c.is_trimmable() for c in cache):
        return False
    return all(c.trim(n) == n for c in cache)


PREFILL_CHUNK_SECONDS = 0.5  # a prefill chunk lasts about this long, so Ctrl-C is noticed soon
FIRST_CHUNK = 256  # tokens of the first chunk, before the speed is known


def prefill(
    model: nn.Module,
    cache: list,
    tokens: mx.array,
    *,
    step_size: int = 2048,
    progress: Callable[[int, int], None] | None = None,
    after_mlx_lm_chunk: Callable[[list], None] | None = None,
) -> None:
    """Run ``tokens`` (n,) through ``model`` into ``cache`` in chunks of at most ``step_size``.

    Chunks start at ``FIRST_CHUNK`` tokens and adapt so each lasts about
    ``PREFILL_CHUNK_SECONDS``: the device is waited on after every chunk, so Ctrl-C
    (KeyboardInterrupt) is raised within about a second whatever the prompt's length.
    ``progress(done, total)`` is called after each chunk. ``after_mlx_lm_chunk(cache)`` is
    called where mlx-lm's generate_step ends a prefill chunk, after every ``step_size`` tokens
    and after the last (no chunk ends inside one of its chunks): it quantizes the KV cache at
    the same points, so every later token attends to the keys mlx-lm's would.
    """
    total, done, chunk = tokens.size, 0, min(step_size, FIRST_CHUNK)
    while done < total:
        n = min(chunk, total - done, step_size - done % step_size)
        tic = time.perf_counter()
        model(tokens[None, done : done + n], cache=cache)
        if after_mlx_lm_chunk is not None and ((done + n) % step_size == 0 or done + n == total):
            after_mlx_lm_chunk(cache)
        mx.eval([c.state for c in cache])
        seconds = time.perf_counter() - tic
        done += n
        if progress is not None:
            progress(done, total)
        # Next chunk: as many tokens as PREFILL_CHUNK_SECONDS allows at this speed (within 2x).
        target = int(n * PREFILL_CHUNK_SECONDS / max(seconds, 1e-6))
        chunk = max(32, min(step_size, 2 * n, target))
        mx.clear_cache()


def of_whole_prompt(
    callback: Callable[[int, int], None] | None, total: int
) -> Callable[[int, int], None] | None:
    """A prefill progress callback over ``prompt[:-1]`` reporting against the whole prompt."""
    return None if callback is None else (lambda done, _: callback(done, total))
