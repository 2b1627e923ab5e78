"""Per-phase timing of decode cycles: draft (the drafting method, drafter forward included), target (the target's
forward over the block), verify (the shared verifier: sampling and acceptance) and commit (everything else: cache
rollback, commits, stop checks, batch bookkeeping). Disabled, it costs one attribute check per phase.

What this module does not know about: what the phases do; on GPU it synchronises at each mark, which itself
slows the loop, so profile runs are for attribution, not for headline speed.
"""

from __future__ import annotations

import time

import torch

PHASES = ("draft", "target", "verify", "commit")


class CycleProfiler:
    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.reset()

    def reset(self) -> None:
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.cycles = 0
        self._last = 0.0

    def _now(self) -> float:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self) -> None:
        if self.enabled:
            self._last = self._now()

    def mark(self, phase: str) -> None:
        if self.enabled:
            now = self._now()
            self.totals[phase] += now - self._last
            self._last = now
            if phase == "commit":
                self.cycles += 1

    def report(self) -> dict:
        """Milliseconds per cycle for each phase and each phase's share of the cycle."""
        total = sum(self.totals.values())
        per_cycle = {p: 1000 * t / max(self.cycles, 1) for p, t in self.totals.items()}
        share = {p: (t / total if total else 0.0) for p, t in self.totals.items()}
        return {"cycles": self.cycles, "ms_per_cycle": per_cycle, "share": share,
                "cycle_ms": 1000 * total / max(self.cycles, 1)}
