"""Statistics of one speculative generation (``Response.spec_stats``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Statistics of one speculative generation (``Response.spec_stats``).

    Attributes:
        drafted / accepted: draft tokens proposed / kept by the target.
        generated: tokens produced.
        target_passes: target forwards after the prompt (speculative and plain).
        plain_passes: of which without drafts (speculation paused or nothing proposed).
        decisions: speculative passes and plain stretches (runs of plain steps) decided; a
            sharded target sends each to the other ranks in one message.
        accepted_lengths: histogram; ``accepted_lengths[n]`` = passes with drafts that kept n.
        draft_seconds / verify_seconds: time spent drafting / in target passes (with each
            pass's bookkeeping: the rollback, the drafter taking the accepted tokens in).
        k_total: sum of the k chosen for passes with drafts (mean k = k_total / their number).
        one_off_seconds: once per generation, the drafter syncing to the context (indexing).
        fallback: why speculation could not run at all (plain decoding was used), else None.
    """

    num_draft_tokens: int | str = "auto"
    drafter: str = ""
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    target_passes: int = 0
    plain_passes: int = 0
    decisions: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    k_total: int = 0
    one_off_seconds: float = 0.0
    fallback: str | None = None

    def record(
        self, k: int, drafted: int, accepted: int, emitted: int, draft_s: float, verify_s: float
    ) -> None:
        """One target pass that verified ``drafted`` tokens, kept ``accepted``, emitted ``emitted``."""
        self.target_passes += 1
        self.generated += emitted
        self.draft_seconds += draft_s
        self.verify_seconds += verify_s
        if drafted == 0:
            self.plain_passes += 1
            return
        self.drafted += drafted
        self.accepted += accepted
        self.k_total += k
        self.accepted_lengths += [0] * (accepted + 1 - len(self.accepted_lengths))
        self.accepted_lengths[accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.generated / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        seconds = self.draft_seconds + self.verify_seconds
        return self.generated / seconds if seconds > 0 else 0.0

    @property
    def mean_k(self) -> float:
        passes = self.target_passes - self.plain_passes
        return self.k_total / passes if passes else 0.0

    def as_dict(self) -> dict:
        return {
            "drafter": self.drafter,
            "num_draft_tokens": self.num_draft_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "generated": self.generated,
            "target_passes": self.target_passes,
            "plain_passes": self.plain_passes,
            "decisions": self.decisions,
            "tokens_per_pass": self.tokens_per_pass,
            "mean_k": self.mean_k,
            "accepted_lengths": list(self.accepted_lengths),
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "tokens_per_second": self.tokens_per_second,
            "one_off_seconds": self.one_off_seconds,
            "fallback": self.fallback,
        }

    def summary(self) -> str:
        """One line for the CLI."""
        if self.fallback:
            return f"speculative: off ({self.fallback})"
        histogram = " ".join(f"{n}:{c}" for n, c in enumerate(self.accepted_lengths) if c)
        return (
            f"speculative ({self.drafter}, k={self.num_draft_tokens}, mean {self.mean_k:.1f}): "
            f"accepted {self.accepted}/{self.drafted} ({100 * self.acceptance_rate:.0f}%), "
            f"{self.tokens_per_pass:.2f} tokens/pass, {self.plain_passes} plain passes, "
            f"accepted lengths [{histogram}], draft {self.draft_seconds:.2f}s / verify "
            f"{self.verify_seconds:.2f}s, {self.tokens_per_second:.1f} tok/s"
        )
