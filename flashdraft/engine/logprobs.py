"""Log-probabilities of committed tokens, for requests that ask for them (`SamplingParams.logprobs`).

Every committed token was chosen at a position whose logits the target computed in the cycle that committed it (the
verify forward of its block, a one-token step, or the prefill for an answer's first token), so its log-probability
costs one log-softmax over logits the engine already has: no extra forward, and the same numbers plain decoding
would report up to the verify's rounding (a 16-token forward sums in another order than a one-token step).

Reported distribution: the target's own, log_softmax(logits), before temperature, top-k and top-p (vLLM's default,
`raw_logprobs`), so a token's figure does not depend on how it was sampled.

A prompt's own tokens (`SamplingParams.prompt_logprobs`, what evaluation harnesses score through `echo`) are the
exception: the prefill keeps only its last position's logits, so `prompt_logprobs` runs the target over the prompt
once more, in chunks of positions whose logits fit PROMPT_LOGITS_CHUNK values.

What this module does not know about: which rows asked (the engine passes their logits), text, the HTTP formats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

MAX_LOGPROBS = 20  # most alternatives a request may ask for per token (OpenAI's top_logprobs bound)
PROMPT_LOGITS_CHUNK = 1 << 26  # logits held at once by `prompt_logprobs` (256 MB in float32; 441 positions at 152k)


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token: its id, its log-probability under the target, and the `top` most likely tokens at its
    position as (id, log-probability), most likely first (empty when the request asked for none); `rank`, where
    computed (prompt tokens), the number of tokens at least as likely as it, itself included (vLLM's rank)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int, ranks: bool = False) -> list[TokenLogprob]:
    """logits [n, V]: the target's logits at the n positions that chose `tokens` (n ids); top: alternatives per
    token; ranks: each token's rank too."""
    dtype = torch.promote_types(logits.dtype, torch.float32)  # float64 targets keep their precision
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])
    rank = (logp >= chosen).sum(-1).tolist() if ranks else [None] * len(tokens)
    chosen = chosen[:, 0].tolist()
    if not top:
        return [TokenLogprob(t, lp, rank=k) for t, lp, k in zip(tokens, chosen, rank)]
    values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
    # a masked token (-inf, a structured output's refusal) is no alternative, and no JSON number either
    return [TokenLogprob(t, lp, tuple((i, v) for i, v in zip(row_ids, row_values) if v != float("-inf")), k)
            for t, lp, k, row_ids, row_values in zip(tokens, chosen, rank, ids.tolist(), values.tolist())]


@torch.inference_mode()
def prompt_logprobs(target, prompt: list[int], top: int) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability and rank given the tokens before it, aligned with the prompt (None first:
    nothing precedes it), by the target's own forward over the prompt (`model.target.TargetModel`, the taps off)."""
    n, out = len(prompt), [None]
    step, cache = max(1, PROMPT_LOGITS_CHUNK // target.vocab_size), DynamicCache()
    for start in range(0, n - 1, step):  # the last token's logits choose the answer's first token, not a prompt's
        end = min(start + step, n - 1)
        ids = torch.tensor([prompt[start:end]], device=target.device)
        logits, _ = target.forward(ids, torch.arange(start, end, device=target.device)[None], None, cache,
                                   capture=False)
        out += token_logprobs(logits[0], prompt[start + 1:end + 1], top, ranks=True)
    return out
