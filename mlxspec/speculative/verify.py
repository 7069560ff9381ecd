"""Verification: which drafted tokens the target keeps, and the token it adds after them.

Three rules, each lossless (every emitted token is distributed exactly as in plain decoding):

- greedy: keep the longest prefix where d_i == argmax p_{i-1}, then emit the target's argmax;
- sampling (Leviathan et al. 2023, Algorithm 1): keep d_i with probability min(1, p(d_i)/q(d_i)),
  at the first rejection emit a sample of normalize(max(0, p - q)), after a full acceptance a
  sample of p_k. The maximal coupling: a draft is kept with probability sum_x min(p, q);
- seeded: the target's token at each position is the Gumbel-max sample of p with that position's
  key (exactly what seeded plain decoding draws); keep drafts while they equal it. The text then
  depends on the seed only, never on k; a draft that sampled with the same keys is kept with
  probability P(argmax(log q + g) == argmax(log p + g)) (<= sum min(p, q); equal for
  deterministic drafts such as prompt lookup).
"""

from __future__ import annotations

import mlx.core as mx

from mlxspec.cpu import argmax
from mlxspec.sampling import gumbel_argmax, sample


def verify_greedy(target_logprobs: mx.array, draft_tokens: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy verification.

    Args:
        target_logprobs: (..., k+1, vocab) target log-probabilities after ``[last, d1..dk]``.
        draft_tokens: (..., k) proposed tokens d1..dk.

    Returns:
        ``(accepted, token)``, both (...): how many drafts equal the target's argmax, and the
        target's own token after them.
    """
    target_tokens = argmax(target_logprobs)  # what plain greedy decoding would emit
    return _keep_agreeing_prefix(target_tokens, draft_tokens)


def _keep_agreeing_prefix(target_tokens: mx.array, draft_tokens: mx.array):
    agree = (target_tokens[..., :-1] == draft_tokens).astype(mx.int32)
    accepted = mx.cumprod(agree, axis=-1).sum(axis=-1)  # length of the agreeing prefix
    token = mx.take_along_axis(target_tokens, accepted[..., None], axis=-1)[..., 0]
    return accepted, token


def verify_sampling(
    p: mx.array, q: mx.array | None, draft_tokens: mx.array
) -> tuple[mx.array, mx.array]:
    """Rejection-sampling verification (Leviathan et al. 2023, Algorithm 1).

    Args:
        p: (..., k+1, vocab) target probabilities after ``[last, d1..dk]`` (processed).
        q: (..., k, vocab) draft probabilities d1..dk were drawn from, or ``None`` for
            deterministic proposals (q one-hot).
        draft_tokens: (..., k) proposed tokens.

    Returns:
        ``(accepted, token)``, both (...): how many drafts are kept, and the token emitted after
        them (a residual sample at the first rejection, or a sample of p_k if all are kept).
    """
    if q is None:  # deterministic proposals: q is one-hot on each draft token
        q = (mx.arange(p.shape[-1]) == draft_tokens[..., None]).astype(p.dtype)
    d = draft_tokens[..., None]
    p_d = mx.take_along_axis(p[..., :-1, :], d, axis=-1)[..., 0]  # p_i(d_i)
    q_d = mx.take_along_axis(q, d, axis=-1)[..., 0]  # q_i(d_i)
    u = mx.random.uniform(shape=p_d.shape)
    keep = (u * q_d < p_d).astype(mx.int32)  # accept d_i with probability min(1, p/q)
    accepted = mx.cumprod(keep, axis=-1).sum(axis=-1)  # drafts before the first rejection
    # The row after the accepted drafts: p - q there, or p_k (q = 0) after a full acceptance.
    q = mx.concatenate([q, mx.zeros((*q.shape[:-2], 1, q.shape[-1]), q.dtype)], axis=-2)
    at = accepted[..., None, None]
    p_row = mx.take_along_axis(p, at, axis=-2)[..., 0, :]
    residual = mx.maximum(p_row - mx.take_along_axis(q, at, axis=-2)[..., 0, :], 0)
    # p == q leaves no residual mass; such a row is only reached through rounding: use p.
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p_row)
    return accepted, sample(residual)


def verify_seeded(
    target_logprobs: mx.array, draft_tokens: mx.array, keys: list[mx.array]
) -> tuple[mx.array, mx.array]:
    """Seeded verification (see the module docstring).

    Args:
        target_logprobs: (k+1, vocab) processed target log-probabilities after ``[last, d1..dk]``.
        draft_tokens: (k,) proposed tokens.
        keys: k+1 position keys (``mlxspec.sampling.position_key``) of the positions d1..dk and
            the one after.

    Returns:
        ``(accepted, token)`` scalars, as ``verify_greedy``.
    """
    target_tokens = mx.concatenate(
        [gumbel_argmax(target_logprobs[i : i + 1], key) for i, key in enumerate(keys)]
    )
    return _keep_agreeing_prefix(target_tokens, draft_tokens)
