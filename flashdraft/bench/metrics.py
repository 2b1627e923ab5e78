"""Aggregation of per-request measurements into the numbers a benchmark reports (docs/design.md, 'Benchmark conventions').

- tau (mean acceptance length) = mean over verification cycles that carried drafts of (accepted drafts + 1), i.e.
  vLLM's 1 + accepted / drafts. Cycles without drafts (prompt lookup found no n-gram, the last token) don't count.
- acceptance rate = accepted drafts / drafted tokens; per-position acceptance rate[i] = share of cycles whose draft
  position i+1 was accepted; histogram[j] = cycles with acceptance length j + 1.
- tau per prompt: each prompt's own tau, reported as a distribution over prompts (min, p10, median, mean): acceptance
  is bimodal across prompts, so one pooled mean hides the prompts where drafting fails.
- tokens/s = output tokens / wall time summed over prompts (prompts run one at a time); speedup = tokens/s over
  `ar`'s tokens/s on the same prompts in the same run; TTFT = time from the call to the first new token; TPOT
  (time per output token) = (wall - TTFT) / (tokens - 1).
- From Prometheus counters (server mode): the same numbers from the deltas of `spec_decode_num_drafts`,
  `..._num_draft_tokens`, `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos{position}`; the histogram
  follows from the per-position counts because acceptance is a prefix: cycles with exactly j accepted =
  per_pos[j-1] - per_pos[j] (per_pos[-1] = drafts).

What this module does not know about: how the measurements were taken.
"""

from __future__ import annotations

import statistics


def acceptance_summary(lengths: list[int], drafted: list[int], max_draft: int) -> dict:
    n = len(lengths)
    if max_draft <= 0:
        return {"tau": None, "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                "acceptance_rate": None, "acceptance_histogram": [], "per_position_acceptance": []}
    width = max([max_draft + 1] + lengths)
    hist = [0] * width
    for a in lengths:
        hist[a - 1] += 1
    accepted = sum(a - 1 for a in lengths)
    return {
        "tau": round(sum(lengths) / n, 4) if n else None,
        "num_drafts": n,
        "num_draft_tokens": sum(drafted),
        "num_accepted_tokens": accepted,
        "acceptance_rate": round(accepted / sum(drafted), 4) if sum(drafted) else None,
        "acceptance_histogram": hist,
        "per_position_acceptance": [round(sum(a > i for a in lengths) / n, 4) if n else 0.0
                                    for i in range(1, width)],
    }


def timing_summary(records: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    decode_tokens = sum(max(r["tokens"] - 1, 0) for r in records)
    decode_time = sum(max(r["wall_s"] - r["ttft_s"], 0.0) for r in records)
    return {
        "output_tokens": tokens,
        "wall_s": round(wall, 6),
        "tokens_per_second": round(tokens / wall, 3) if wall > 0 else 0.0,
        "ttft_ms": round(1000 * statistics.fmean(r["ttft_s"] for r in records), 3) if records else None,
        "tpot_ms": round(1000 * decode_time / decode_tokens, 3) if decode_tokens else None,
    }


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def prompt_distribution(records: list[dict]) -> dict | None:
    """Tau per prompt (the records' "tau": their drafting cycles' mean; prompts that never drafted left out) as a
    distribution: min, p10, median, mean and how many prompts; None if no prompt drafted."""
    taus = [r["tau"] for r in records if r.get("tau") is not None]
    if not taus:
        return None
    return {"min": round(min(taus), 3), "p10": round(percentile(taus, 0.1), 3),
            "median": round(percentile(taus, 0.5), 3), "mean": round(statistics.fmean(taus), 3), "prompts": len(taus)}


def from_counters(delta: dict) -> dict:
    """Acceptance numbers from Prometheus counter deltas ({"drafts", "draft_tokens", "accepted", "per_pos": {i: n}})."""
    drafts = delta.get("drafts") or 0
    if not drafts:
        return {"tau": None, "num_drafts": 0, "num_draft_tokens": delta.get("draft_tokens") or 0,
                "num_accepted_tokens": delta.get("accepted") or 0, "acceptance_rate": None,
                "acceptance_histogram": [], "per_position_acceptance": []}
    accepted = delta.get("accepted") or 0
    draft_tokens = delta.get("draft_tokens") or 0
    per_pos = delta.get("per_pos") or {}
    out = {
        "tau": round(1 + accepted / drafts, 4),
        "num_drafts": int(drafts),
        "num_draft_tokens": int(draft_tokens),
        "num_accepted_tokens": int(accepted),
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
        "acceptance_histogram": [],
        "per_position_acceptance": [],
    }
    if per_pos:
        k = max(per_pos) + 1
        counts = [per_pos.get(i, 0) for i in range(k)]
        out["per_position_acceptance"] = [round(c / drafts, 4) for c in counts]
        at_least = [drafts] + counts + [0]  # at_least[j] = cycles with >= j accepted
        out["acceptance_histogram"] = [int(at_least[j] - at_least[j + 1]) for j in range(k + 1)]
    return out
