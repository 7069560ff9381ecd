"""How the next token is drawn: sampling parameters, logits processors and the distributions.

A leaf module (it imports only mlx, mlx-lm's sampling filters and mlxspec.errors): decoding loops,
drafters and verifiers all build on it.

mlx-lm's ``make_sampler`` returns tokens, not distributions. Speculative sampling needs the
probabilities of the target and the draft after the *same* transform, so ``processed_logprobs``
rebuilds that transform from mlx-lm's own filters, applied under the same conditions and in the
same order: top-p, then min-p, then top-k, all on the untempered log-probabilities, then the
temperature (``categorical(logprobs / temp)``). Sampling from ``processed_logprobs`` is therefore
sampling from ``make_sampler(temp, top_p, min_p, top_k)``; ``tests/test_sampling.py`` checks it.

Seeded generations draw every random number from a key of its own absolute position
(``position_key``), so the text depends on the seed and the context only, never on how many
tokens a speculative pass drafted.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_sampler,
)

from mlxspec.cpu import argmax, exp
from mlxspec.errors import InvalidArgumentError

# (token history (n,) int, logits (1, vocab)) -> logits, as mlx-lm's logits processors.
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is drawn from the model's distribution. ``temp == 0`` is greedy.

    Raises ``InvalidArgumentError`` for values outside: finite ``temp >= 0``, ``0 < top_p <= 1``,
    integer ``top_k >= 0``, ``0 <= min_p <= 1``.
    """

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not _is_real(self.temp) or not math.isfinite(self.temp) or self.temp < 0:
            raise InvalidArgumentError(f"temp={self.temp!r}: use a finite number >= 0 (0 is greedy)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidArgumentError(f"top_p={self.top_p!r}: use a number in (0, 1] (1 keeps all)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidArgumentError(f"top_k={self.top_k!r}: use a whole number >= 0 (0 keeps all)")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidArgumentError(f"min_p={self.min_p!r}: use a number in [0, 1] (0 is off)")

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def sampler(self, seed: int | None = None, position: int = 0) -> Callable[[mx.array], mx.array]:
        """A sampler taking logprobs (1, vocab) to a token (1,) uint32.

        Without ``seed``: mlx-lm's ``make_sampler`` (MLX's global random state). With ``seed``: the
        same distribution drawn with ``position_key(seed, p)`` for the p-th call, ``p`` counting
        from ``position`` (the absolute position of the first token it draws).
        """
        if self.greedy:
            return argmax  # mlx-lm's greedy sampler's answer, in one vectorized op on a CPU
        if seed is None:
            top_p = self.top_p if self.top_p < 1.0 else 0.0
            sampler = make_sampler(self.temp, top_p=top_p, min_p=self.min_p, top_k=self.top_k)
            if self.top_k == 0:
                return sampler
            # mlx-lm refuses top_k >= vocab; keeping the top k of fewer tokens keeps them all.
            keep_all = make_sampler(self.temp, top_p=top_p, min_p=self.min_p, top_k=0)
            return lambda logprobs: (
                keep_all if self.top_k >= logprobs.shape[-1] else sampler)(logprobs)
        next_position = position

        def keyed(logprobs: mx.array) -> mx.array:
            nonlocal next_position
            token = gumbel_argmax(processed_logprobs(logprobs, self), position_key(seed, next_position))
            next_position += 1
            return token

        return keyed


def check_seed(seed: int | None) -> None:
    """Raise ``InvalidArgumentError`` unless ``seed`` is None or an int in [0, 2**63)."""
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise InvalidArgumentError(f"seed={seed!r}: use a whole number from 0 to 2**63 - 1")


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_greedy_sampler(sampler: Callable[[mx.array], mx.array] | None) -> bool:
    """Whether ``sampler`` takes the argmax: mlx-lm's greedy sampler or ``SamplingParams``'s."""
    return sampler is argmax or sampler is greedy_sampler


def normalized_logprobs(logits: mx.array) -> mx.array:
    """``logits - logsumexp(logits)`` over the last axis, exactly as mlx-lm's generate_step.

    The one log-softmax of mlxspec: (..., vocab) -> (..., vocab), same dtype.
    """
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def processed_logprobs(logprobs: mx.array, sampling: SamplingParams) -> mx.array:
    """Log-probabilities of the distribution the sampler draws from.

    Args:
        logprobs: (..., vocab) normalized log-probabilities (after logits processors).
        sampling: the sampling parameters; ``temp`` must be > 0 (greedy has no distribution).

    Returns:
        (..., vocab) float32 normalized log-probabilities; ``-inf`` for filtered-out tokens.
    """
    if sampling.greedy:
        raise ValueError("greedy decoding (temp=0) has no sampling distribution")
    # Same filters, same conditions, same order as mlx_lm.sample_utils.make_sampler.
    if 0.0 < sampling.top_p < 1.0:
        logprobs = apply_top_p(logprobs, sampling.top_p)
    if sampling.min_p != 0.0:
        logprobs = apply_min_p(logprobs, sampling.min_p)
    if 0 < sampling.top_k < logprobs.shape[-1]:  # k >= vocab keeps every token
        logprobs = apply_top_k(logprobs, sampling.top_k)
    # mlx-lm samples categorical(logprobs * (1 / temp)); normalize that to log-probabilities.
    return normalized_logprobs(logprobs.astype(mx.float32) * (1.0 / sampling.temp))


def processed_probs(logprobs: mx.array, sampling: SamplingParams) -> mx.array:
    """(..., vocab) probabilities of the processed distribution (see ``processed_logprobs``)."""
    return exp(processed_logprobs(logprobs, sampling))  # one vectorized op on a CPU


def sample(probs: mx.array, key: mx.array | None = None) -> mx.array:
    """One token per row of ``probs`` (..., vocab), drawn exactly from that distribution.

    Rows need not be normalized; zero entries are never drawn. Returns (...) uint32.
    """
    return mx.random.categorical(mx.log(probs), key=key).astype(mx.uint32)


def position_key(seed: int, position: int) -> mx.array:
    """The random key of absolute token position ``position`` in a generation seeded with ``seed``
    (a splitmix64 mix of both, so neighbouring seeds and positions get unrelated keys)."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return mx.random.key(z ^ (z >> 31))


def gumbel_argmax(logprobs: mx.array, key: mx.array) -> mx.array:
    """A sample of softmax(logprobs) (1, vocab) -> (1,) uint32 by the Gumbel-max trick.

    The noise depends on ``key`` only: two distributions perturbed with the same key give the
    same token whenever they agree enough (the coupling seeded speculative decoding relies on).
    """
    noise = mx.random.gumbel(logprobs.shape, key=key)
    return mx.argmax(logprobs + noise, axis=-1).astype(mx.uint32)
