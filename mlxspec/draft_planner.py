"""How many tokens to draft per step, and the statistics of a speculative generation.

``DraftLengthPlanner`` with ``"auto"`` picks, before every target pass, the draft length k that
maximises the expected tokens per second

    rate(k) = E[tokens per pass] / (k * draft_cost + verify_cost(k)),
    E[tokens per pass] = (1 - a^(k+1)) / (1 - a)          (Leviathan et al. 2023, eq. 1)

where a is the per-token acceptance rate and the costs are measured online (moving averages of
the passes so far; the verify cost is a line c0 + slope * k fitted through the measured passes,
with the prompt prefill's cost per token as the prior slope; the draft step cost starts from the
drafter's own measurement). Switching speculation on also costs a catch-up: the draft model must
first process the tokens it has not seen (the prompt, or what was generated while speculation was
paused); speculation is chosen only if it wins over the tokens left, catch-up included.

k = 0 is a plain decoding step: when no k wins, speculation pauses for a number of tokens that
doubles each time the pause is confirmed, then tries again, so a change of content or of costs is
noticed. When even a perfect draft (a = 1) cannot win (e.g. a BLAS for which a pass over k tokens
costs k single steps), or when each retry's catch-up would cost a sizeable fraction of the paused
time, it pauses for much longer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

K_MAX = 16  # longest draft "auto" considers
EMA = 0.3  # weight of the newest measurement in the moving averages
ACCEPTANCE_MEMORY = 0.9  # per-pass decay of the acceptance counts
MARGIN = 0.05  # speculation must beat plain decoding by this fraction to be used
MIN_PAUSE, MAX_PAUSE, HOPELESS_PAUSE = 16, 256, 1024  # plain tokens before trying again
TRIAL_PASSES = 1  # speculative passes after a pause before judging again
PLAIN_PASSES_FIRST = 2  # plain passes measured before speculation is considered
PRIOR_ACCEPTANCE = 0.3  # acceptance rate assumed before any draft is verified
MIN_PREFILL_FOR_PRIOR = 8  # prompt tokens needed to take the prefill cost as the prior slope
HORIZON = 256  # tokens over which switching speculation on must pay off
RETRY_COST = 0.05  # longest catch-up (fraction of the paused tokens' plain time) worth a retry


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens per target pass with k drafts each accepted with probability ``a``."""
    a = min(max(a, 0.0), 0.999)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new


class DraftLengthPlanner:
    """Chooses k for each pass of one generation (see the module docstring).

    Args:
        num_draft_tokens: a fixed k, or ``"auto"``.
        draft_step, catch_up_step: the drafter's own estimates (priors) of seconds per drafted
            token and per context token it catches up on, if any.
    """

    def __init__(
        self,
        num_draft_tokens: int | str = "auto",
        draft_step: float | None = None,
        catch_up_step: float | None = None,
    ):
        self.fixed = None if num_draft_tokens == "auto" else int(num_draft_tokens)
        # Decayed counts of kept drafts and of passes ending in a rejection; the prior (0.3, worth
        # two observations) is cautious: only drafts that are cheap enough get tried.
        self.accepted, self.rejected = PRIOR_ACCEPTANCE * 2, (1 - PRIOR_ACCEPTANCE) * 2
        self.draft_cost = draft_step  # seconds per drafted token
        self.catch_up_cost = catch_up_step  # seconds per context token the drafter catches up on
        self.plain_passes = 0  # measured plain passes
        self.verify_costs: dict[int, float] = {}  # drafts in the pass -> seconds per pass
        self.prior_slope: float | None = None  # seconds per extra token in a pass (prefill)
        self.paused = 0  # plain passes left before speculation is tried again
        self.pause = MIN_PAUSE
        self.trial = 0  # speculative passes left before the next judgement

    # -- measurements ----------------------------------------------------------------------------

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The prompt prefill: a pass over many tokens, the prior for the verify cost slope."""
        if tokens >= MIN_PREFILL_FOR_PRIOR:
            self.prior_slope = seconds / tokens

    def observe(
        self, k: int, drafted: int, accepted: int, draft_s: float, verify_s: float, fed: int
    ) -> None:
        """One pass: k requested, ``drafted`` proposed, ``accepted`` kept, times in seconds.

        ``fed`` is how many context tokens the drafter processed first (1-2 in steady state; more
        is a catch-up, whose cost per token is measured separately).
        """
        self.verify_costs[drafted] = _ema(self.verify_costs.get(drafted), verify_s)
        self.plain_passes += drafted == 0
        if drafted > 0:
            self.accepted = ACCEPTANCE_MEMORY * self.accepted + accepted
            self.rejected = ACCEPTANCE_MEMORY * self.rejected + (accepted < drafted)
        if k > 0 and fed <= 2:
            self.draft_cost = _ema(self.draft_cost, draft_s / k)
        elif k > 0:
            extra = max(draft_s - k * (self.draft_cost or 0.0), 0.0) / (fed - 1)
            self.catch_up_cost = _ema(self.catch_up_cost, extra)

    # -- the model -------------------------------------------------------------------------------

    @property
    def acceptance(self) -> float:
        """Per-token acceptance rate: kept drafts / (kept drafts + passes ending in a rejection)."""
        return self.accepted / (self.accepted + self.rejected)

    def verify_cost(self, k: int) -> float:
        """Predicted seconds of a target pass over k drafts (plus the last token)."""
        c0 = self.verify_costs[0]
        points = [(j, c - c0) for j, c in self.verify_costs.items() if j > 0]
        if points:  # least-squares slope of the measured passes through (0, c0)
            slope = sum(j * dc for j, dc in points) / sum(j * j for j, _ in points)
        else:
            slope = self.prior_slope or 0.0
        return c0 + max(slope, 0.0) * k

    def catch_up_seconds(self, tokens: int) -> float:
        """Predicted seconds for the drafter to process ``tokens`` unseen context tokens."""
        if tokens <= 2:
            return 0.0  # part of a normal draft step
        per_token = self.catch_up_cost
        if per_token is None:  # prior: the draft batches tokens as well as the target does
            c0 = self.verify_costs[0]
            batching = (self.prior_slope or c0) / c0
            per_token = (self.draft_cost or 0.0) * min(batching, 1.0)
        return (tokens - 1) * per_token

    def rate(self, k: int, acceptance: float | None = None) -> float:
        """Predicted tokens per second with k drafts per pass."""
        a = self.acceptance if acceptance is None else acceptance
        seconds = k * (self.draft_cost or 0.0) + self.verify_cost(k)
        return expected_tokens(a, k) / max(seconds, 1e-9)

    def best_k(self, limit: int, acceptance: float | None = None) -> int:
        """The k in 1..limit with the highest predicted rate."""
        ks = range(1, min(K_MAX, limit) + 1)
        return max(ks, key=lambda k: self.rate(k, acceptance))

    # -- the decision ----------------------------------------------------------------------------

    def choose(self, limit: int, catch_up: int = 0) -> int:
        """k for the next pass.

        Args:
            limit: the most drafts worth making (tokens left - 1).
            catch_up: context tokens the drafter has not processed yet.
        """
        if limit <= 0:
            return 0
        if self.fixed is not None:
            return min(self.fixed, limit)
        if self.paused > 0:
            self.paused -= 1
            return 0
        if self.plain_passes < PLAIN_PASSES_FIRST:  # measure plain decoding first
            return 0
        k = self.best_k(limit)
        if self.trial > 0:
            self.trial -= 1
            return k
        # Time for the tokens left (up to HORIZON) with speculation, catch-up included, or without.
        horizon = min(limit + 1, HORIZON)
        speculative = self.catch_up_seconds(catch_up) + horizon / self.rate(k)
        if speculative * (1 + MARGIN) < horizon / self.rate(0):
            self.pause = MIN_PAUSE
            return k
        # Plain decoding is predicted faster: pause. Much longer if even a = 1 could not win, or
        # if catching up after the pause would cost a sizeable part of the paused time.
        c0 = self.verify_costs[0]
        hopeless = self.rate(self.best_k(limit, 1.0), 1.0) <= (1 + MARGIN) * self.rate(0)
        hopeless |= self.catch_up_seconds(self.pause + 1) > RETRY_COST * self.pause * c0
        self.paused = (HOPELESS_PAUSE if hopeless else self.pause) - 1
        self.pause = min(2 * self.pause, MAX_PAUSE)
        self.trial = TRIAL_PASSES
        return 0

    def plain_stretch(self, limit: int) -> int:
        """After ``choose`` returned 0: how many plain passes follow from now (this one included,
        at most ``limit``), so they can run back to back. They are consumed."""
        stretch = min(self.paused + 1, limit)
        self.paused -= stretch - 1
        return stretch


@dataclass
class SpecStats:
    """Statistics of one speculative generation (``Response.spec_stats``).

    Attributes:
        drafted / accepted: draft tokens proposed / kept by the target.
        generated: tokens produced.
        target_passes: target forwards after the prompt (speculative and plain).
        plain_passes: of which without drafts (speculation paused or nothing proposed).
        accepted_lengths: histogram; ``accepted_lengths[n]`` = passes with drafts that kept n.
        draft_seconds / verify_seconds: time spent drafting / in target passes.
        k_total: sum of the k chosen for passes with drafts (mean k = k_total / their number).
        fallback: why speculation could not run at all (plain decoding was used), else None.
    """

    num_draft_tokens: int | str = "auto"
    drafter: str = ""
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    target_passes: int = 0
    plain_passes: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    k_total: int = 0
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
            "tokens_per_pass": self.tokens_per_pass,
            "mean_k": self.mean_k,
            "accepted_lengths": list(self.accepted_lengths),
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "tokens_per_second": self.tokens_per_second,
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
