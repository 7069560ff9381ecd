"""The EAGLE-3 training recipe: a fresh head for a target, and the training-time-test loss.

Training-time test (EAGLE-3, section 3.2; SpecForge's ``OnlineEagle3Model``): the head is
unrolled ``steps`` times over a whole sequence at once. Step 0 reads the target's fused features;
step j > 0 reads the head's own outputs of step j - 1, so it learns from its own predictions as
it will draft. At step j the query of position t stands for the drafted position t + j: it
attends to the step-0 keys of positions <= t (the context, from the target's features) and to
the keys of steps 1..j at position t only (the chain drafted after t), which is the attention a
draft chain sees at inference, all positions in parallel.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxspec.speculative.eagle3 import Eagle3Config, Eagle3Head, default_taps, target_shape

STEP_DECAY = 0.8  # weight of step j's loss: STEP_DECAY ** j (SpecForge's)


def new_head(model: nn.Module, draft_ids: list[int], extra: dict[str, Any]) -> Eagle3Head:
    """A one-layer head shaped like one target layer, its LM head and norm copied from the
    target's (rows of the draft vocabulary), the rest freshly initialised.

    Args:
        draft_ids: the target ids of the draft vocabulary, ascending.
        extra: mlxspec's fields for the config (target name, tokenizer fingerprint, ...).
    """
    args = model.args
    hidden, layers, rows = target_shape(model)
    config = Eagle3Config(
        hidden_size=hidden, intermediate_size=args.intermediate_size,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads, vocab_size=rows,
        draft_vocab_size=len(draft_ids), target_hidden_size=hidden,
        head_dim=getattr(args, "head_dim", None), rms_norm_eps=args.rms_norm_eps,
        rope_theta=args.rope_theta, rope_scaling=getattr(args, "rope_scaling", None),
        max_position_embeddings=args.max_position_embeddings, taps=default_taps(layers),
        extra=extra)
    head = Eagle3Head(config, model.model.embed_tokens)
    ids = mx.array(draft_ids, mx.int32)
    head.d2t = ids - mx.arange(len(draft_ids), dtype=mx.int32)
    inner = model.model
    out = inner.embed_tokens if args.tie_word_embeddings else model.lm_head
    head.lm_head.weight = _dense_rows(out, ids, args.tie_word_embeddings, hidden)
    head.norm.weight = mx.array(inner.norm.weight)
    head.fc.weight = head.fc.weight * 0.5  # three taps summed: keep the start's scale near one
    mx.eval(head.parameters())
    return head


def _dense_rows(layer: nn.Module, ids: mx.array, tied: bool, hidden: int) -> mx.array:
    """Rows ``ids`` of the target's output layer, dense whatever its (quantized) format: an
    embedding looks them up; a linear layer's weight is read back as layer(I) transposed."""
    if tied:
        return layer(ids).astype(mx.float32)
    return layer(mx.eye(hidden)).T[ids].astype(mx.float32)


def _projections(attn: nn.Module, x: mx.array, offset: int) -> tuple[mx.array, ...]:
    B, T, _ = x.shape
    q = attn.q_proj(x).reshape(B, T, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(x).reshape(B, T, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = attn.v_proj(x).reshape(B, T, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q, k = attn.rope(q, offset=offset), attn.rope(k, offset=offset)
    repeat = attn.n_heads // attn.n_kv_heads
    if repeat > 1:
        k, v = mx.repeat(k, repeat, axis=1), mx.repeat(v, repeat, axis=1)
    return q, k, v


def unrolled_logits(head: Eagle3Head, features: mx.array, tokens: mx.array, steps: int):
    """Draft-vocabulary logits of every training-time-test step.

    Args:
        features: (B, T, 3 * H) the target's fused taps at positions 0..T-1.
        tokens: (B, T + steps - 1) the token after each position: ``tokens[:, t + j]`` is the
            input of step j at position t (token t + 1 + j of the sequence).

    Returns:
        A list of ``steps`` arrays (B, T, draft_vocab): step j at position t predicts token
        t + 2 + j.
    """
    B, T, _ = features.shape
    layer, attn = head.midlayer, head.midlayer.self_attn
    hidden = head.fc(features)
    causal = mx.triu(mx.full((T, T), -mx.inf), k=1)
    keys, values, outs = [], [], []
    for j in range(steps):
        embeds = head.embed(tokens[:, j : j + T]).astype(hidden.dtype)
        x, residual = layer.inputs(embeds, hidden)
        q, k, v = _projections(attn, x, offset=j)  # step j's position t is t + j
        keys.append(k)
        values.append(v)
        scores = [(q * attn.scale) @ keys[0].transpose(0, 1, 3, 2) + causal]
        scores += [mx.sum(q * attn.scale * ki, axis=-1, keepdims=True) for ki in keys[1:]]
        weights = mx.softmax(mx.concatenate(scores, axis=-1).astype(mx.float32), axis=-1)
        weights = weights.astype(q.dtype)
        mixed = weights[..., :T] @ values[0]
        for i, vi in enumerate(values[1:], 1):
            mixed = mixed + weights[..., T + i - 1 : T + i] * vi
        attended = attn.o_proj(mixed.transpose(0, 2, 1, 3).reshape(B, T, -1))
        hidden = layer.finish(attended, residual)
        outs.append(head.logits(hidden))
    return outs


def ttt_loss(
    head: Eagle3Head, features: mx.array, tokens: mx.array, target_ids: mx.array,
    target_probs: mx.array, mask: mx.array, steps: int,
) -> tuple[mx.array, mx.array]:
    """The training-time-test loss and each step's top-1 agreement with the target.

    Args:
        features, tokens: as ``unrolled_logits``.
        target_ids: (B, T + steps, K) draft ids of the target's top-K tokens at each position
            (-1: off the draft vocabulary); position t's are the target's next-token choices.
        target_probs: (B, T + steps, K) their probabilities (renormalised over the kept ones).
        mask: (B, T + steps) 1 where the position's next token is trained on (answers).

    Returns:
        ``(loss scalar, agreement (steps,))``: soft cross-entropy to the target's top-K,
        weighted ``STEP_DECAY ** j``; agreement is P(head top-1 == target top-1) at step j.
    """
    T = features.shape[1]
    total, agree = 0.0, []
    for j, logits in enumerate(unrolled_logits(head, features, tokens, steps)):
        ids, probs = target_ids[:, 1 + j : 1 + j + T], target_probs[:, 1 + j : 1 + j + T]
        weight = mask[:, 1 + j : 1 + j + T] * (ids[..., 0] >= 0)
        logprobs = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), -1,
                                                            keepdims=True)
        picked = mx.take_along_axis(logprobs, mx.maximum(ids, 0), axis=-1)
        ce = -mx.sum(mx.where(ids >= 0, probs * picked, 0.0), axis=-1)
        count = mx.maximum(weight.sum(), 1)
        total = total + STEP_DECAY**j * (ce * weight).sum() / count
        hit = (mx.argmax(logits, axis=-1) == ids[..., 0]) * weight
        agree.append(hit.sum() / count)
    return total, mx.stack(agree)
