"""The built-in calibration set: windows from several domains, and the model's own answers.

A quantizer fits the text it sees (GPTQ's roundings, AWQ's scales, distillation's scales), so
one author's prose teaches it one domain. The built-in set is a mix of domains, each a few
thousand tokens (texts in ``mlxspec/data``, sources and licences in ``data/PROVENANCE.md``):

- ``prose``: Jane Austen (*Pride and Prejudice*, 1813), the King James Bible (1611, *Genesis*)
  and Ambrose Bierce's *The Devil's Dictionary* (1911, letters A-D);
- ``code``: whole modules of Python's standard library (PSF licence);
- ``technical``: topics of Python's language reference (``pydoc_data``, PSF licence);
- ``chat``: **self-generated** conversations: the model's own answers to the built-in prompts
  (``data/calibration_prompts.txt``), sampled with mlxspec's batch generation and rendered with
  the model's chat template. No outside data: the text is what the model produces when it is
  used as an assistant. This is the data-free calibration of LLM-QAT (Liu et al., 2023,
  "LLM-QAT: Data-Free Quantization Aware Training for Large Language Models", which trains on the
  model's own sampled generations) and of self-calibration (Williams, Chrysostomou and Aletras,
  NAACL 2025, "Self-calibration for Language Model Quantization and Pruning"), here started from
  prompts so that the text is the chat the model is run on.

Each domain's windows are spread evenly over its token stream (every source of the domain is
represented). :data:`DEFAULT_MIX` is the share of windows per domain, chosen by measurement
(``bench/results/quantized.json``, ``docs/quantization-quality.md``).

    conversations = generate_conversations(model, tokenizer, chat_prompts_needed(32, 256))
    windows, record = mixed_windows(tokenizer, conversations=conversations, windows=32,
                                    window_tokens=256)

(:func:`mlxspec.publish.self_calibration.generate_conversations`: generation is an upper layer's
job; this module only cuts windows.)
"""

from __future__ import annotations

import hashlib
import json
import math
from importlib import resources
from itertools import zip_longest
from typing import Any

from mlxspec.chat_template import chat_prompt
from mlxspec.errors import QuantizationError

# domain -> the texts of mlxspec/data it is cut from (the chat domain is generated)
SOURCES: dict[str, tuple[str, ...]] = {
    "prose": ("calibration.txt", "calibration_prose.txt"),
    "code": ("calibration_code.txt",),
    "technical": ("calibration_technical.txt",),
}
PROMPTS_FILE = "calibration_prompts.txt"
DOMAINS = (*SOURCES, "chat")
# Share of the calibration windows per domain (normalised over the domains available). Measured
# (SmolLM2 GPTQ 4-bit g64, KL pooled / worst held-out domain, docs/quantization-quality.md):
# these four equal 0.401 / 0.421; without chat 0.417 / 0.427; chat only 0.427 / 0.453; chat
# weighted 3x 0.427 / 0.445; the Austen-only text 0.519 / 0.600.
DEFAULT_MIX: dict[str, float] = {"prose": 1.0, "code": 1.0, "technical": 1.0, "chat": 1.0}
ANSWER_TOKENS = 256  # tokens per generated answer
SAMPLING = {"temp": 0.7, "top_p": 0.95}  # sampled, not greedy: greedy answers of small models loop
SEED = 0


def data_text(name: str) -> str:
    """A text shipped in ``mlxspec/data``."""
    return (resources.files("mlxspec") / "data" / name).read_text(encoding="utf-8")


def prompts() -> list[str]:
    """The built-in prompts of the self-generated calibration (one per line)."""
    return [p for p in data_text(PROMPTS_FILE).splitlines() if p.strip()]


def spread_windows(ids: list[int], count: int, window_tokens: int) -> list[list[int]]:
    """``count`` windows of ``window_tokens`` consecutive ids, evenly spaced over ``ids`` (as
    many as fit when fewer do; non-overlapping)."""
    fit = len(ids) // window_tokens
    count = min(count, fit)
    if count < 1:
        return []
    starts = [round(i * (len(ids) - window_tokens) / max(1, count - 1)) if count > 1 else 0
              for i in range(count)]
    return [ids[s : s + window_tokens] for s in starts]


def conversation_tokens(tokenizer, conversations: list[list[dict[str, str]]]) -> list[int]:
    """The conversations rendered with the tokenizer's chat template, one after another."""
    ids: list[int] = []
    for messages in conversations:
        ids.extend(chat_prompt(tokenizer, messages, add_generation_prompt=False))
    return ids


def _shares(mix: dict[str, float], windows: int) -> dict[str, int]:
    """Whole windows per domain in proportion to ``mix`` (largest remainders)."""
    total = sum(mix.values())
    exact = {d: windows * w / total for d, w in mix.items()}
    out = {d: math.floor(x) for d, x in exact.items()}
    for d in sorted(exact, key=lambda d: out[d] - exact[d])[: windows - sum(out.values())]:
        out[d] += 1
    return out


def chat_prompts_needed(windows: int, window_tokens: int, mix: dict[str, float] | None = None
                        ) -> list[str]:
    """The built-in prompts (evenly chosen) whose answers fill the chat domain's share of
    ``windows`` (an answer and its prompt fill about 3/4 of :data:`ANSWER_TOKENS`)."""
    mix = {d: w for d, w in (mix or DEFAULT_MIX).items() if w > 0}
    count = _shares(mix, windows).get("chat", 0)
    questions = prompts()
    wanted = min(len(questions), math.ceil(count * window_tokens / (0.75 * ANSWER_TOKENS)))
    return [questions[int(i * len(questions) / wanted)] for i in range(wanted)]


def mixed_windows(
    tokenizer,
    *,
    conversations: list[list[dict[str, str]]] | None = None,
    windows: int,
    window_tokens: int,
    mix: dict[str, float] | None = None,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Calibration windows of the built-in set.

    Args:
        tokenizer: an mlx-lm TokenizerWrapper (``encode``; ``apply_chat_template`` for chat).
        conversations: the self-generated ``chat`` domain: the float model's answers to
            :func:`chat_prompts_needed` (``mlxspec.publish.self_calibration``); None (or a
            tokenizer without a chat template) leaves that domain out.
        windows, window_tokens: how many windows in all, of how many tokens.
        mix: share per domain (default :data:`DEFAULT_MIX`); a domain with share 0 is left out.

    Returns:
        ``(windows, record)``: the windows, the domains interleaved, and what ``config.json`` records:
        ``{"calibration": "builtin:prose=8,code=8,...", "calibration_sha256": sha256 of the
        windows' token ids}``.
    """
    mix = {d: w for d, w in (mix or DEFAULT_MIX).items() if w > 0}
    unknown = set(mix) - set(DOMAINS)
    if unknown:
        raise QuantizationError(f"unknown calibration domains {sorted(unknown)}: choose from "
                                f"{', '.join(DOMAINS)}")
    no_chat = conversations is None
    if "chat" in mix and (no_chat or not getattr(tokenizer, "chat_template", None)):
        mix.pop("chat")  # nothing to generate with
    if not mix:
        raise QuantizationError("the calibration mix is empty: give at least one domain")
    shares = _shares(mix, windows)
    by_domain: list[list[list[int]]] = []
    for domain, count in shares.items():
        if count == 0:
            continue
        if domain == "chat":
            ids = conversation_tokens(tokenizer, conversations)
        else:
            text = "\n\n".join(data_text(name) for name in SOURCES[domain])
            ids = list(tokenizer.encode(text, add_special_tokens=False))
        by_domain.append(spread_windows(ids, count, window_tokens))
    # interleaved, so that any slice (a batch, distillation's held-out tail) holds every domain
    out = [w for group in zip_longest(*by_domain) for w in group if w is not None]
    if not out:
        raise QuantizationError("the built-in calibration set gave no windows: use fewer tokens "
                                "per window")
    digest = hashlib.sha256(json.dumps(out).encode()).hexdigest()
    label = ",".join(f"{d}={n}" for d, n in shares.items() if n)
    return out, {"calibration": f"builtin:{label}", "calibration_sha256": digest}


def windows_text(tokenizer, windows: list[list[int]]) -> str:
    """The windows decoded back to text, separated by blank lines: the same calibration set as
    a file, for tools that read text (``--calibration FILE``, mlx-lm's quantizers)."""
    return "\n\n".join(tokenizer.decode(w) for w in windows) + "\n"
