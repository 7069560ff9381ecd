"""What the continuous-batching ``Engine`` takes and gives: a ``Request`` (one completion to
generate, checked when it is built), the logits processors it asks for, and the ``Event`` objects
the engine's steps return."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlx_lm.sample_utils import make_logits_processors

from mlxspec.grammar import GrammarProcessor
from mlxspec.sampling import LogitsProcessor, SamplingParams, check_seed


@dataclass
class Request:
    """One completion to generate.

    Attributes:
        prompt: token ids (the chat template, if any, already applied).
        max_tokens: the most tokens to generate.
        temp, top_p, top_k, min_p: sampling (``temp == 0`` is greedy).
        stop: strings that end generation (not included in the text).
        seed: seeds MLX's generator when the request is admitted (exactly reproducible only when
            the request runs alone: batched requests share the generator). A seeded request is
            never speculative (the draft length depends on measured speed).
        logprobs: report the log-probability of each generated token.
        top_logprobs: also report this many most likely alternatives per token.
        repetition_penalty, logit_bias: mlx-lm's logits processors.
        grammar: constrained decoding: only text this grammar (``mlxspec.grammar``: a JSON
            schema's, a tool-call format's) allows is generated.
    """

    prompt: list[int]
    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: Sequence[str] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        # Checked here, where every caller (serve, batch, Python) builds a request: a bad value
        # is that request's InvalidArgumentError, never an exception inside the shared batch step.
        _ = self.sampling
        check_seed(self.seed)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temp=self.temp, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p)


@dataclass
class Event:
    """New output of one request: text (possibly empty while a stop string may be starting).

    ``finish_reason`` is ``"stop"`` (end of sequence or a stop string) or ``"length"`` on the last
    event of a request, else ``None``. Token counts are totals so far.
    """

    rid: int
    text: str
    token: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    speculative: bool = False


def request_processors(request: Request, tokenizer: Any) -> list[LogitsProcessor]:
    """The logits processors ``request`` asks for: mlx-lm's (logit bias, repetition penalty) and
    its grammar's (``mlxspec.grammar.GrammarProcessor``; its prompt is the first history shown)."""
    processors = make_logits_processors(request.logit_bias, request.repetition_penalty)
    if request.grammar:
        processors.append(GrammarProcessor(tokenizer, request.grammar, start=len(request.prompt)))
    return processors


def solo_safe(processors: Sequence[LogitsProcessor]) -> bool:
    """Whether a stream with these processors may leave the batch for speculative decoding:
    a grammar follows any history it is shown (``GrammarProcessor.view``); mlx-lm's processors
    need the batch's token history."""
    return all(isinstance(p, GrammarProcessor) for p in processors)
