"""Log-probabilities of committed tokens, for requests that ask for them (`SamplingParams.logprobs`).

Every committed token was chosen at a position whose logits the target computed in the cycle that committed it (the
verify forward of its block, a one-token step, or the prefill for an answer's first token), so its log-probability
costs one log-softmax over logits the engine already has: no extra forward, and the same numbers plain decoding
would report up to the verify's rounding (a 16-token forward sums in another order than a one-token step).

Reported distribution: the target's own, log_softmax(logits), before temperature, top-k and top-p (vLLM's default,
`raw_logprobs`), so a token's figure does not depend on how it was sampled.

What this module does not know about: which rows asked (the engine passes their logits), text, the HTTP formats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # most alternatives a request may ask for per token (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token: its id, its log-probability under the target, and the `top` most likely tokens at its
    position as (id, log-probability), most likely first (empty when the request asked for none)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits [n, V]: the target's logits at the n positions that chose `tokens` (n ids); top: alternatives per token."""
    dtype = torch.promote_types(logits.dtype, torch.float32)  # float64 targets keep their precision
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    if not top:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
    return [TokenLogprob(t, lp, tuple(zip(row_ids, row_values)))
            for t, lp, row_ids, row_values in zip(tokens, chosen, ids.tolist(), values.tolist())]
