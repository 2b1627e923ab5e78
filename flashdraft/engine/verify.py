"""The one verifier every drafting method shares: accepted, rejected, bonus.

Given the target's logits over a block and a method's draft tokens (with their draft distribution, or none for
one-hot drafts such as DFlash's argmax), decide per row how many drafts are accepted and which token comes next:
- greedy rows (temperature 0): accept while the draft equals the target's argmax; the next token is the target's
  argmax after the last accepted draft. Output equals the target's own greedy decoding.
- sampled rows with counter-based noise (`noise.py`, the default sampler): at each block position the target's
  token is the winner of the exponential race argmax p / E under the noise of that (request seed, output
  position); accept while the draft equals it, the next token is the winner after the last accepted draft. Every
  committed token is the target's own sample under that noise, so the output is plain decoding's with the same
  seed, whatever proposed the drafts.
- sampled rows without noise: standard speculative rejection sampling (Leviathan et al. / Chen et al.). Draft
  token x is accepted with probability min(1, p(x) / q(x)); on the first rejection the next token is drawn from
  the residual max(0, p - q) renormalised; if every draft is accepted, the bonus is drawn from p after the block.
  With a one-hot q this accepts x with probability p(x), and the residual is p with x removed.
Either way the committed tokens are distributed exactly as the target's own samples (temperature, top-k, top-p
applied to p).

Trees (`tree.py`, `verify_tree`): the walk starts at the root and follows the target's own token at each node (its
argmax, its race winner under the noise of the node's output position, or without noise a sample drawn from p
there) while that token is one of the node's children; the token that is not is the next token. Every committed
token is the target's own choice given the tokens before it, so trees keep all of the above, and under the noise
the output is again plain decoding's with the same seed.

What this module does not know about: KV caches, positions, stop conditions (the engine commits what we return).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.engine.argmax import argmax, kth_largest, sort_descending
from flashdraft.engine.noise import race, race_offsets


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature 0 means greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if any((not isinstance(s, str)) or s == "" for s in self.stop_strings):
            raise ValueError("stop_strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The distribution the target samples from: softmax(logits / T) restricted by top-k then top-p (float32)."""
    scores = logits.float() / max(temperature, 1e-6)
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        scores = scores.masked_fill(scores < kth_largest(scores, top_k), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        descending = sort_descending(probs)
        # keep the smallest prefix (largest first) whose mass reaches top_p, the token that crosses it included, and
        # every token as probable as the prefix's last: tied tokens are kept or dropped together, whatever order a
        # sort put them in (only the sorted values are needed, and numpy sorts them ~20x faster on CPU). The mass
        # before each place never decreases (a running sum of non-negative terms, less a non-increasing one), so
        # the prefix's length is a binary search
        before = descending.cumsum(dim=-1) - descending
        length = torch.searchsorted(before, before.new_full((*before.shape[:-1], 1), top_p))
        probs = probs * (probs >= descending.gather(-1, length - 1))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


@dataclass
class Verdict:
    """Per row: how many drafts were accepted, and the next token (the bonus, or the correction after a rejection)."""

    num_accepted: torch.Tensor  # [b] long
    next_tokens: torch.Tensor  # [b] long


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    draft_probs: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> Verdict:
    """Verify drafts against the target.

    target_logits [b, k+1, V]: the target's logits at the k+1 block positions (position i predicts draft i+1).
    draft_tokens [b, k]. draft_probs [b, k, V] or None for one-hot drafts. params: one per row.
    noise [b, k+1, V] or None: each sampled row's exponential noise at the block positions (`noise.py`); with it,
    sampled rows commit the race winners (generators and draft_probs are then not needed).
    """
    b, k = draft_tokens.shape
    device = target_logits.device
    num_accepted = torch.zeros(b, dtype=torch.long, device=device)
    next_tokens = torch.zeros(b, dtype=torch.long, device=device)
    # greedy rows, and sampled rows racing on softmax(logits / T) alone, all at once (their own token at every
    # block position; a row's result does not depend on the others'): a loop over rows cost ~45 us per row on CPU
    greedy = [r for r, p in enumerate(params) if p.greedy]
    raced = [r for r, p in enumerate(params) if noise is not None and not p.greedy and p.top_k == 0 and p.top_p == 1.0]
    for rows, racing in ((greedy, False), (raced, True)):
        if not rows:
            continue
        idx = None if len(rows) == b else torch.tensor(rows, device=device)
        pick = (lambda t: t) if idx is None else (lambda t: t.index_select(0, idx))  # noqa: E731
        logits = pick(target_logits)
        if racing:
            # the race on softmax(logits / T) as the argmax of logits - T log E: the form the screened read-out
            # computes (`greedy_readout.py`), so both paths pick by the same expression
            temperatures = torch.tensor([max(params[r].temperature, 1e-6) for r in rows], device=device)
            chosen = argmax(logits.float() + race_offsets(pick(noise), temperatures))
        else:
            chosen = argmax(logits)
        verdict = accept_chosen(chosen, pick(draft_tokens))
        if idx is None:
            return verdict
        num_accepted[idx], next_tokens[idx] = verdict.num_accepted, verdict.next_tokens
    done = set(greedy) | set(raced)
    for row, p in enumerate(params):
        if row in done:
            continue
        logits = target_logits[row]
        if noise is not None:
            # the target's own token at every block position (the winner of its race under the row's noise, on p
            # restricted by top-k / top-p): accept drafts while they equal it, then commit it
            chosen = race(target_probs(logits, p.temperature, p.top_p, p.top_k), noise[row])
            acc = int((draft_tokens[row] == chosen[:k]).long().cumprod(0).sum())
            num_accepted[row], next_tokens[row] = acc, chosen[acc]
            continue
        probs = target_probs(logits, p.temperature, p.top_p, p.top_k)  # [k+1, V]
        drafts = draft_tokens[row]
        gen = generators[row] if generators else None
        p_draft = probs[:k].gather(-1, drafts[:, None])[:, 0]
        q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs[row].float().gather(-1, drafts[:, None])[:, 0]
        u = torch.rand(k, generator=gen, device=device)
        accept = (u * q_draft < p_draft).long()
        acc = int(accept.cumprod(0).sum())
        if acc == k:
            dist = probs[k]
        else:
            residual = probs[acc].clone()
            if draft_probs is None:
                residual[drafts[acc]] = 0.0
            else:
                residual = (residual - draft_probs[row, acc].float()).clamp_min(0.0)
            total = residual.sum()
            # p == q exactly leaves no residual mass; then any sample from p is correct (it was just rejected by
            # a probability-zero event), so fall back to p.
            dist = residual / total if total > 0 else probs[acc]
        num_accepted[row] = acc
        next_tokens[row] = torch.multinomial(dist, 1, generator=gen)[0]
    return Verdict(num_accepted, next_tokens)


def accept_chosen(chosen: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
    """Rows whose target token at every block position is already known, chosen [b, k+1] (its argmax, or its
    race winner under the row's noise): drafts [b, k] are accepted while they equal it, then it comes next."""
    k = draft_tokens.shape[1]
    acc = (draft_tokens == chosen[:, :k]).long().cumprod(dim=1).sum(dim=1)
    return Verdict(acc, chosen.gather(1, acc[:, None])[:, 0])


@dataclass
class TreeVerdict(Verdict):
    """Also each row's accepted path: the tree's node indices from the root, one per committed draft plus the root."""

    paths: list[list[int]]


def verify_tree(
    target_logits: torch.Tensor,
    tree,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    noise: torch.Tensor | None = None,
) -> TreeVerdict:
    """Walk token trees (`tree.TokenTree`, g rows of n nodes) against the target's logits at their nodes [g, n, V].

    noise [g, depth + 1, V] or None: each sampled row's exponential noise by output position (the root's first);
    without it, sampled rows draw the target's token at each node they reach from p with their generator."""
    greedy_choice = argmax(target_logits).tolist()  # [g][n]
    children = tree.children()
    depths = tree.depths
    num_accepted, next_tokens, paths = [], [], []
    for row, p in enumerate(params):
        if p.greedy:
            chosen = greedy_choice[row].__getitem__
        elif noise is not None:  # every node's race winner under the noise of its output position
            probs = target_probs(target_logits[row], p.temperature, p.top_p, p.top_k)
            chosen = race(probs, noise[row].index_select(0, depths[row])).tolist().__getitem__
        else:
            gen = generators[row] if generators else None

            def chosen(node, row=row, p=p, gen=gen):  # the target's own sample at the node, drawn when reached
                probs = target_probs(target_logits[row, node], p.temperature, p.top_p, p.top_k)
                return int(torch.multinomial(probs, 1, generator=gen)[0])
        path = [0]
        token = chosen(0)
        while (path[-1], token) in children[row]:
            path.append(children[row][(path[-1], token)])
            token = chosen(path[-1])
        num_accepted.append(len(path) - 1)
        next_tokens.append(token)
        paths.append(path)
    device = target_logits.device
    return TreeVerdict(torch.tensor(num_accepted, device=device), torch.tensor(next_tokens, device=device), paths)


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None] | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row from logits [b, V] (the first token after prefill); noise [b, 1, V] or None."""
    empty = torch.zeros(logits.shape[0], 0, dtype=torch.long, device=logits.device)
    return verify(logits[:, None, :], empty, params, generators, noise=noise).next_tokens
