"""Draft-length policies: how many tokens a batch verifies in its next cycle.

Each live batch holds one policy object. Before a cycle the engine asks `block_width(block_size)`: the block size
(draft `block_size - 1` tokens after the bonus) or 1 (a one-token step: no draft, the same verifier). After the
cycle it reports `observe(drafted, tau)` with the batch's mean acceptance length; `rows_joined()` when new
requests enter the batch.

- `AlwaysDraft`: every cycle drafts a full block (the default).
- `MinTauFallback(min_tau)`: once the smoothed acceptance length of at least MIN_DRAFTS_TO_JUDGE drafts falls
  below `min_tau`, the batch takes one-token steps for a while (8, then 16, 32 ... 128 while probes keep losing),
  then probes with one draft. The decision depends on acceptance only, never on timing.
- `CostAwareFallback(costs)` (`min_tau="auto"`): the same, with `min_tau` = what a drafting cycle costs in one-token
  steps at the batch's row count, measured while serving (`StepCosts`, shared by an engine's batches): a batch
  drafts while drafting commits more tokens per second than plain decoding would. It takes one one-token step to
  measure that cost if it has none yet. Timing makes its choices depend on the machine's load; the output does
  not, for greedy rows and with the default sampler (whose text is plain decoding's whatever is drafted), but
  with `sampler="rejection"` it would, so the engine refuses that combination.

What this module does not know about: drafters, caches; time only as the seconds the engine reports.
"""

from __future__ import annotations

MIN_PLAIN_RUN, MAX_PLAIN_RUN = 8, 128  # one-token steps per fallback, doubling while probes keep losing
MIN_DRAFTS_TO_JUDGE = 3  # drafting cycles (since the start or a won probe) before the policy may fall back


class AlwaysDraft:
    def block_width(self, block_size: int) -> int:
        return block_size

    def observe(self, drafted: bool, tau: float, rows: int = 1, seconds: float | None = None) -> None:
        pass

    def rows_joined(self) -> None:
        pass


class MinTauFallback:
    def __init__(self, min_tau: float):
        self.min_tau = min_tau
        self.rows_joined()

    def rows_joined(self) -> None:
        """New rows: draft again, judged afresh."""
        self.plain_steps_left = 0  # one-token steps before the next draft
        self.plain_run = MIN_PLAIN_RUN  # how many the next fallback takes
        self.recent_tau, self.recent_drafts = 0.0, 0  # smoothed acceptance length of recent drafts, their count
        self.probing = False

    def block_width(self, block_size: int) -> int:
        return 1 if self.plain_steps_left > 0 else block_size

    def observe(self, drafted: bool, tau: float, rows: int = 1, seconds: float | None = None) -> None:
        if not drafted:
            self.plain_steps_left -= 1
            return
        if self.probing:  # a probe that reaches min_tau resumes drafting; a losing one doubles the next run
            self.probing = False
            if tau >= self.min_tau:
                self.plain_run, self.recent_tau, self.recent_drafts = MIN_PLAIN_RUN, tau, 1
                return
            self.plain_run = min(2 * self.plain_run, MAX_PLAIN_RUN)
        else:
            self.recent_tau = tau if self.recent_drafts == 0 else 0.7 * self.recent_tau + 0.3 * tau
            self.recent_drafts += 1
            if self.recent_drafts < MIN_DRAFTS_TO_JUDGE or self.recent_tau >= self.min_tau:
                return
        self.plain_steps_left, self.probing = self.plain_run, True


class StepCosts:
    """Smoothed seconds of a drafting cycle and of a one-token step, per row count (costs grow with rows, and
    differently: a verify of rows x block tokens against a step of rows tokens)."""

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.seconds: dict[tuple[int, bool], float] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        """Row counts are pooled in powers of two (a served batch moves through every count)."""
        return 1 << max(0, rows - 1).bit_length()

    def record(self, rows: int, drafted: bool, seconds: float) -> None:
        key = (self.bucket(rows), drafted)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else (1 - self.smoothing) * old + self.smoothing * seconds

    def cycle_in_steps(self, rows: int) -> float | None:
        """A drafting cycle's cost in one-token steps at this row count's bucket (None until both were measured
        there: costs at other row counts say little, a verify grows with rows x block, a step with rows)."""
        cycle, step = self.seconds.get((self.bucket(rows), True)), self.seconds.get((self.bucket(rows), False))
        return cycle / step if cycle is not None and step else None


class CostAwareFallback(MinTauFallback):
    def __init__(self, costs: StepCosts):
        self.costs = costs
        super().__init__(min_tau=1.0)
        MinTauFallback.rows_joined(self)  # the one reset: at the start

    def rows_joined(self) -> None:
        """Rows joining a served batch do not reset the judgment (under load they join every few cycles; the
        batch's smoothed acceptance takes them in within a few cycles, and a fallback run still ends in a probe)."""

    def observe(self, drafted: bool, tau: float, rows: int = 1, seconds: float | None = None) -> None:
        if seconds is not None:
            self.costs.record(rows, drafted, seconds)
        ratio = self.costs.cycle_in_steps(rows)
        if ratio is None:  # no one-token step measured at this row count yet: take one (after a few drafts at first)
            if drafted:
                self.recent_tau = tau if self.recent_drafts == 0 else 0.7 * self.recent_tau + 0.3 * tau
                self.recent_drafts += 1
                if self.recent_drafts >= MIN_DRAFTS_TO_JUDGE and self.plain_steps_left == 0:
                    self.plain_steps_left = 1
            else:
                self.plain_steps_left -= 1
            return
        self.min_tau = max(1.0, ratio)
        super().observe(drafted, tau)


def new_policy(min_tau: float | str | None, block_size: int, costs: StepCosts | None = None):
    """The policy a new batch of an engine with these settings starts with."""
    if min_tau is None or block_size <= 1:
        return AlwaysDraft()
    if min_tau == "auto":
        return CostAwareFallback(costs if costs is not None else StepCosts())
    return MinTauFallback(min_tau)
