"""Draft-length policies: how many tokens a batch verifies in its next cycle.

Each live batch holds one policy object. Before a cycle the engine asks `block_width(block_size)`: the block size
(draft `block_size - 1` tokens after the bonus) or 1 (a one-token step: no draft, the same verifier). After the
cycle it reports `observe(drafted, tau)` with the batch's mean acceptance length; `rows_joined()` when new
requests enter the batch.

- `AlwaysDraft`: every cycle drafts a full block (the default).
- `MinTauFallback(min_tau)`: once the smoothed acceptance length of at least MIN_DRAFTS_TO_JUDGE drafts falls
  below `min_tau`, the batch takes one-token steps for a while (8, then 16, 32 ... 128 while probes keep losing),
  then probes with one draft. The decision depends on acceptance only, never on timing, so seeded sampling stays
  reproducible.

What this module does not know about: drafters, caches, time.
"""

from __future__ import annotations

MIN_PLAIN_RUN, MAX_PLAIN_RUN = 8, 128  # one-token steps per fallback, doubling while probes keep losing
MIN_DRAFTS_TO_JUDGE = 3  # drafting cycles (since the start or a won probe) before the policy may fall back


class AlwaysDraft:
    def block_width(self, block_size: int) -> int:
        return block_size

    def observe(self, drafted: bool, tau: float) -> None:
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

    def observe(self, drafted: bool, tau: float) -> None:
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


def new_policy(min_tau: float | None, block_size: int):
    """The policy a new batch of an engine with these settings starts with."""
    return MinTauFallback(min_tau) if min_tau is not None and block_size > 1 else AlwaysDraft()
