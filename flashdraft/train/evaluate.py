"""Acceptance measured the way it is served: tau on held-out prompts with the real `SpecEngine`.

`evaluate_tau` runs greedy speculative generation of the drafter against the target on the given prompts and
aggregates over all draft cycles: tau (mean acceptance length, the bonus token counted) and the per-position
acceptance rate, as docs/design.md, 'Benchmark conventions' defines them (vLLM's conventions). Greedy output is
the target's own, and the fixed draft policy verifies the whole block every cycle (no timing-dependent one-token
steps), so this measures the drafter only.

What this module does not know about: training state; it leaves the drafter in the train/eval mode it found.
"""

from __future__ import annotations

import torch

from flashdraft.engine import SamplingParams, SpecEngine


def evaluate_tau(target, drafter, prompts: list[list[int]], max_new_tokens: int = 64, batch_size: int = 16,
                 stop_token_ids: tuple[int, ...] = ()) -> dict:
    """{"tau", "per_position_acceptance", "num_cycles", "num_prompts", "output_tokens"} over all cycles."""
    was_training = drafter.training
    drafter.eval()
    lengths: list[int] = []
    out_tokens = 0
    try:
        # closed at the end: an evaluation every few hundred steps must not pile hooks up on the target (a shared
        # `TargetModel`, as the trainer's, gets its layer ids back)
        with SpecEngine(target, drafter, draft_policy="fixed") as engine:
            params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_token_ids))
            for start in range(0, len(prompts), batch_size):
                for res in engine.generate(prompts[start:start + batch_size], params):
                    lengths.extend(res.stats.acceptance_lengths)
                    out_tokens += len(res.token_ids)
    finally:
        drafter.train(was_training)
    block = int(drafter.block_size)
    n = len(lengths)
    t = torch.tensor(lengths, dtype=torch.float32) if n else torch.zeros(0)
    per_pos = [float((t > i).float().mean()) if n else 0.0 for i in range(1, block)]
    return {"tau": float(t.mean()) if n else 0.0, "per_position_acceptance": [round(x, 4) for x in per_pos],
            "num_cycles": n, "num_prompts": len(prompts), "output_tokens": out_tokens}
