"""A sliding-window KV cache that can process several tokens at once and roll back exactly.

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

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, _BaseCache, make_prompt_cache


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


def rollback_cache(cache: list) -> tuple[list, str | None]:
    """``cache`` with each ``RotatingKVCache`` swapped for a ``WindowKVCache``, and the reason it
    cannot roll back (None when it can)."""
    reason = cannot_roll_back(cache)
    if reason is not None:
        return cache, reason
    return [
        WindowKVCache.from_rotating(c) if isinstance(c, RotatingKVCache) else c for c in cache
    ], None


def make_cache(model: nn.Module, max_kv_size: int | None = None) -> list:
    """The model's prompt cache; with ``max_kv_size``, full-attention layers get a rotating one.

    mlx-lm's ``make_prompt_cache`` ignores ``max_kv_size`` for models that define ``make_cache``
    (llama does, in mlx-lm 0.32), so the bounded cache is built here for any model: each plain
    ``KVCache`` becomes ``RotatingKVCache(max_kv_size, keep=4)``, as mlx-lm does for the others.
    """
    cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    if max_kv_size is None:
        return cache
    return [
        RotatingKVCache(max_size=max_kv_size, keep=4) if type(c) is KVCache else c for c in cache
    ]
