"""How many tokens to draft per pass (``num_draft_tokens="auto"``).

Before every target pass ``DraftLengthPlanner`` picks the draft length k that maximises the
predicted tokens per second

    rate(k) = E[tokens per pass] / (k * draft_cost + verify_cost(k)),
    E[tokens per pass] = (1 - a^(k+1)) / (1 - a)          (Leviathan et al. 2023, eq. 1)

where a is the per-token acceptance rate (decayed counts of the passes so far) and the costs are
measured online, robustly: each estimate is the lower median of the last ``WINDOW`` measurements,
so one slow pass (a kernel compiled on first use, a busy machine) is outvoted as soon as a second
pass of the same kind is measured, and the first pass of a generation (warm-up) is not used at
all. The verify cost is c0 + slope * k, the slope the lower median of the measured lengths'
slopes (before any speculative pass: the prompt prefill's cost per token); c0, the plain cost,
is bounded by the passes that verified drafts (``plain_cost``: the first plain steps of a
generation can all be slow). One-off costs (the drafter catching up on a long context) are
measured per caught-up token and charged only when a catch-up is due, never to the per-token
drafting cost.

k = 0 is a plain decoding step. Speculation starts with a trial once plain decoding is measured:
no "off" verdict comes before at least one speculative pass was measured (unless its catch-up
alone would cost more than the tokens left could repay). When plain decoding is predicted faster
it pauses for a number of tokens that doubles up to ``MAX_PAUSE`` and then runs a trial of
``TRIAL_PASSES`` passes again: it backs off but never gives up, unless the drafter's catch-up
after the pause would cost more than ``RETRY_COST`` of the paused time (then the pause doubles
and the retry waits). The catch-up grows with the pause, so a drafter whose catch-up costs more
than ``RETRY_COST`` of a plain step per token (a draft model whose batched forward is that
dear) is not retried again in that generation (the next generation plans afresh).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

K_MAX = 16  # longest draft "auto" considers
WINDOW = 8  # recent measurements behind each cost estimate
ACCEPTANCE_MEMORY = 0.9  # per-pass decay of the acceptance counts
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.5, 2.0  # acceptance assumed before any draft is verified
MARGIN = 0.03  # speculation must be predicted this much faster than plain decoding
# Plain passes measured (after the warm-up pass) before the first trial, run back to back as
# plain decoding runs (pipelined): the first steps after a prompt can take twice the steady
# step (SmolLM2 on a CPU: 26-37 ms against 12-14), and a plain cost read from them alone makes
# every speculative pass look cheap (speculation never pauses, and drafts too long).
PLAIN_FIRST = 4
TRIAL_PASSES = 2  # speculative passes of a trial before judging
MIN_PAUSE, MAX_PAUSE = 16, 512  # plain tokens before trying again
# Hopeless: the drafts kept since the last accepted one (none) would be that unlikely
# (< HOPELESS_LIKELIHOOD) if the first draft of a pass were accepted as often as it must be
# for k = 1 to break even. Then speculation pauses at once (the acceptance estimate, still
# leaning on its prior, is not asked), the next pause grows 4x (not 2x) and the retry is a
# single pass: a drafter far too weak for its cost costs a few passes per generation, while a
# cheap one (break-even acceptance near 0, e.g. prompt lookup) is never judged this way.
HOPELESS_LIKELIHOOD = 0.2
MIN_PREFILL_FOR_PRIOR = 8  # prompt tokens needed to take the prefill cost as the prior slope
HORIZON = 256  # tokens over which switching speculation on must pay off
RETRY_COST = 0.05  # longest catch-up (fraction of the paused tokens' plain time) worth a retry
FIRST_TRIAL_COST = 0.25  # longest catch-up (fraction of the tokens left's plain time) for the first


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens per target pass with k drafts each accepted with probability ``a``."""
    a = min(max(a, 0.0), 0.999)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def lower_median(values) -> float | None:
    """The lower median (robust to a minority of slow outliers); None when empty."""
    if not values:
        return None
    return sorted(values)[(len(values) - 1) // 2]


@dataclass
class AcceptanceCount:
    """A per-token acceptance rate from decayed counts: drafts kept, and passes ending in a
    rejection, starting from ``acceptance`` weighted as ``PRIOR_WEIGHT`` passes."""

    kept: float
    missed: float

    @classmethod
    def prior(cls, acceptance: float = PRIOR_ACCEPTANCE) -> AcceptanceCount:
        return cls(acceptance * PRIOR_WEIGHT, (1 - acceptance) * PRIOR_WEIGHT)

    def record(self, kept: int, drafted: int) -> None:
        """One pass that kept ``kept`` of ``drafted`` drafts; older passes decay."""
        self.kept = ACCEPTANCE_MEMORY * self.kept + kept
        self.missed = ACCEPTANCE_MEMORY * self.missed + (kept < drafted)

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.missed)


@dataclass
class PassCosts:
    """What one generation's planner measured, for the next generations of the same drafter and
    target (a chat, a server's lone streams): seconds per drafted token, per caught-up token and
    per pass by drafts verified (the same machine and model: no need to measure them again),
    and the acceptance rate the generation ended with, greedy and sampled apart (the next one's
    prior: a workload's drafts tend to fare alike, but sampling keeps fewer of them than greedy
    decoding; ``acceptance[greedy]``). A short answer has only a few passes, and learning both
    afresh took several of them: ``mlxspec serve --prompt-lookup``'s lone stream on ~25-token
    edits of its prompt went from 50-51 to 51-55 tokens/s with them kept (SmolLM2, 2 CPU cores,
    alternating runs; a fixed k = 7 still made 66-72 there: auto-k ramps up within each answer)."""

    draft: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    catch_up: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    verify: dict[int, deque[float]] = field(default_factory=dict)
    acceptance: dict[bool, float] = field(
        default_factory=lambda: {True: PRIOR_ACCEPTANCE, False: PRIOR_ACCEPTANCE})


class DraftLengthPlanner:
    """Chooses k for each pass of one generation (see the module docstring).

    Args:
        num_draft_tokens: a fixed k, or ``"auto"``.
        draft_step, catch_up_step: the drafter's own estimates (priors) of seconds per drafted
            token and per context token it catches up on, if any.
        costs: earlier generations' measurements to go on from (updated in place; the
            drafter's ``pass_costs``), or None to start afresh.
        greedy: whether the generation decodes greedily (the acceptance prior it starts from).
    """

    interruptible = False  # ``interrupts`` never ends a plain stretch early

    def __init__(
        self,
        num_draft_tokens: int | str = "auto",
        draft_step: float | None = None,
        catch_up_step: float | None = None,
        costs: PassCosts | None = None,
        greedy: bool = True,
    ):
        self.fixed = None if num_draft_tokens == "auto" else int(num_draft_tokens)
        self.costs = costs = PassCosts() if costs is None else costs
        self.greedy = greedy
        self.counts = AcceptanceCount.prior(costs.acceptance[greedy])
        self.draft_prior, self.catch_up_prior = draft_step, catch_up_step
        self.draft_costs = costs.draft  # seconds per drafted token
        self.catch_up_costs = costs.catch_up  # seconds per caught-up token
        self.verify_costs = costs.verify  # drafts verified -> seconds per pass
        self.prior_slope: float | None = None  # seconds per extra token in a pass (prefill)
        self.passes = 0  # passes observed (the first is a warm-up, not timed)
        self.speculative_passes = 0
        self.paused = 0  # plain passes left before speculation is tried again
        self.pauses = 0  # pauses started
        self.pause = self.served_pause = MIN_PAUSE
        self.trial = 0  # speculative passes of the current trial still to run
        self.since_accept = 0  # speculative passes since a draft was last accepted

    # -- measurements ----------------------------------------------------------------------------

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The prompt prefill: a pass over many tokens, the prior for the verify cost slope."""
        if tokens >= MIN_PREFILL_FOR_PRIOR:
            self.prior_slope = seconds / tokens

    def observe(
        self, k: int, drafted: int, accepted: int, draft_s: float, verify_s: float, caught_up: int
    ) -> None:
        """One pass: k requested, ``drafted`` proposed, ``accepted`` kept, times in seconds.

        ``caught_up`` is how many context tokens the drafter processed first (1-2 in steady
        state; more is a catch-up, whose cost per token is measured separately).
        """
        self.passes += 1
        # k drafts asked for and none verified (a grammar refused them all): a pass that kept
        # nothing, not a plain step; counted as plain, the planner ran such passes unpipelined
        # for ever (no speculative pass ever measured: the first trial never ended).
        refused = k > 0 and drafted == 0
        if drafted > 0 or refused:
            self.speculative_passes += 1
            self.counts.record(accepted, max(drafted, 1))
            self.costs.acceptance[self.greedy] = self.acceptance
            self.since_accept = 0 if accepted else self.since_accept + 1
        if self.passes == 1:
            return  # warm-up: first use of the shapes (kernel compilation, caches)
        if not refused:  # a lone unpipelined step is no measure of plain decoding
            self.verify_costs.setdefault(drafted, deque(maxlen=WINDOW)).append(verify_s)
        if k == 0:
            return
        if caught_up <= 2:
            self.draft_costs.append(draft_s / max(drafted, 1))  # a confidence stop drafts < k
        else:
            extra = max(draft_s - drafted * self.draft_cost, 0.0) / (caught_up - 1)
            self.catch_up_costs.append(extra)

    # -- the model -------------------------------------------------------------------------------

    @property
    def acceptance(self) -> float:
        """Per-token acceptance rate: kept drafts / (kept drafts + passes ending in a rejection)."""
        return self.counts.rate

    @property
    def draft_cost(self) -> float:
        """Seconds per drafted token."""
        measured = lower_median(self.draft_costs)
        return measured if measured is not None else (self.draft_prior or 0.0)

    @property
    def plain_cost(self) -> float:
        """Seconds per plain decoding pass (needs a measured plain pass).

        A pass that verified drafts costs at least a plain step. When such passes measured less
        (the lower median of all of them, pooled: one quick pass of a rarely chosen length is
        outvoted), the plain steps were measured slow (the first steps after a prompt can take
        twice the steady step, and a generation measures plain decoding there first), and they
        bound the plain cost instead. Against the slow value every verified draft looked free,
        and prompt lookup, whose drafts cost nothing, drafted 9-13 tokens a pass for 1.4
        (SmolLM2, 2 CPU cores, a code answer it matches poorly, alternating runs: 0.87x plain
        decoding where a fixed k = 1 made 1.17x; with the bound 1.01x against 1.15x)."""
        plain = lower_median(self.verify_costs[0])
        drafted = [t for j, c in self.verify_costs.items() if j > 0 for t in c]
        return min(plain, lower_median(drafted)) if drafted else plain

    def verify_line(self) -> tuple[float, float]:
        """Seconds of a plain pass and seconds more per verified draft (>= 0): the lower median
        of the slopes of the draft lengths whose passes cost more than the plain cost (none:
        the prefill's cost per token, 0 without one)."""
        c0 = self.plain_cost
        medians = ((j, lower_median(c)) for j, c in self.verify_costs.items() if j > 0 and c)
        slopes = [(m - c0) / j for j, m in medians if m > c0]
        slope = lower_median(slopes) if slopes else (self.prior_slope or 0.0)
        return c0, slope

    def verify_cost(self, k: int) -> float:
        """Predicted seconds of a target pass over k drafts (plus the last token)."""
        c0, slope = self.verify_line()
        return c0 + slope * k

    def catch_up_seconds(self, tokens: int) -> float:
        """Predicted seconds for the drafter to process ``tokens`` unseen context tokens."""
        if tokens <= 2:
            return 0.0  # part of a normal draft step
        per_token = lower_median(self.catch_up_costs)
        if per_token is None:
            per_token = self.catch_up_prior
        if per_token is None:  # the draft batches tokens as well as the target does
            c0 = self.plain_cost
            per_token = self.draft_cost * min((self.prior_slope or c0) / c0, 1.0)
        return (tokens - 1) * per_token

    def rate(self, k: int) -> float:
        """Predicted tokens per second with k drafts per pass."""
        return self._rate(k, self.draft_cost, *self.verify_line())

    def best_k(self, limit: int) -> int:
        """The k in 1..limit with the highest predicted rate (the costs read once: each read
        takes the medians of every measured length, ~0.2 ms for 16 candidates otherwise)."""
        costs = (self.draft_cost, *self.verify_line())
        return max(range(1, min(K_MAX, limit) + 1), key=lambda k: self._rate(k, *costs))

    def _rate(self, k: int, draft: float, c0: float, slope: float) -> float:
        return expected_tokens(self.acceptance, k) / max(k * draft + c0 + slope * k, 1e-9)

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
        measured = len(self.verify_costs.get(0, ()))
        if measured < PLAIN_FIRST:  # measure plain decoding first, as it runs: a stretch
            self.paused = PLAIN_FIRST - measured - 1 + (self.passes == 0)  # with the warm-up
            return 0
        horizon = min(limit + 1, HORIZON)
        plain_seconds = horizon * self.plain_cost
        if self.trial > 0 or self.speculative_passes == 0:
            # A trial: measure before judging, unless catching up alone would not pay.
            # The first trial's passes (before any pause) against the tokens left; a retry's
            # against the pause it follows.
            budget = (
                FIRST_TRIAL_COST * plain_seconds
                if self.pauses == 0
                else RETRY_COST * self._paused_time()
            )
            # A retry of a hopeless drafter is for catching it once it has become useful; with
            # fewer tokens left than the pause a failure would start, there is no time to use it.
            too_late = self._hopeless() and limit + 1 < self.pause
            if self.catch_up_seconds(catch_up) <= budget and not too_late:
                self.trial = (self.trial or TRIAL_PASSES) - 1
                return self.best_k(limit)
            return self._pause()
        if self._hopeless():
            return self._pause()
        k = self.best_k(limit)
        speculative_seconds = self.catch_up_seconds(catch_up) + horizon / self.rate(k)
        if speculative_seconds * (1 + MARGIN) < plain_seconds:
            self.pause = MIN_PAUSE
            return k
        return self._pause()

    def _paused_time(self) -> float:
        return self.served_pause * self.plain_cost  # the pause just served

    def _pause(self) -> int:
        """Decode plainly for the current pause, then try again (the next pause is longer)."""
        hopeless = self._hopeless()
        self.pauses += 1
        self.paused, self.served_pause = self.pause - 1, self.pause
        self.pause = min((4 if hopeless else 2) * self.pause, MAX_PAUSE)
        self.trial = 1 if hopeless else TRIAL_PASSES
        return 0

    def _hopeless(self) -> bool:
        """No draft accepted for so many passes that a drafter good enough to pay at k = 1
        (first-draft acceptance >= the break-even one) would rarely do as badly."""
        if self.since_accept == 0 or not self.verify_costs.get(0):
            return False
        break_even = (self.draft_cost + self.verify_cost(1)) / self.plain_cost - 1.0
        break_even = min(max(break_even, 0.0), 0.99)
        return (1.0 - break_even) ** self.since_accept < HOPELESS_LIKELIHOOD

    def plain_stretch(self, limit: int) -> int:
        """After ``choose`` returned 0: how many plain passes follow from now (this one included,
        at most ``limit``), so they can run back to back. They are consumed."""
        stretch = min(self.paused + 1, limit)
        self.paused -= stretch - 1
        return stretch

    def plain_stretch_ended(self, unused: int) -> None:
        """The stretch ended ``unused`` passes early (``interrupts``): they stay paused."""
        self.paused += unused

    def interrupts(self) -> bool:
        """Whether the plain stretch running should end after the pass queued now (a planner
        of one drafter never cuts its own pause short)."""
        return False

    def ready(self) -> bool:
        """Whether ``choose`` would consider drafting now: plain decoding measured, no pause."""
        measured = len(self.verify_costs.get(0, ()))
        return self.fixed is not None or (self.paused == 0 and measured >= PLAIN_FIRST)

    def pass_by(self) -> None:
        """A plain pass, run for another drafter's pause, where this planner's drafter would have
        drafted: it counts toward this planner's pause too."""
        self.paused = max(self.paused - 1, 0)
