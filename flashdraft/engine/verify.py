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

import numbers
from dataclasses import dataclass

import torch

from flashdraft.engine.argmax import argmax, fill_below, kth_largest, largest_sorted, sort_descending
from flashdraft.engine.logprobs import MAX_LOGPROBS
from flashdraft.engine.noise import race, race_offsets
from flashdraft.engine.structured import StructuredOutput


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature 0 means greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # tokens less probable than min_p x the likeliest one's probability are dropped (vLLM's)
    # the first min_tokens output tokens cannot be stop ids (their logits are -inf there), and stop strings count
    # only once the output is longer than min_tokens (vLLM's min_tokens)
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # the text leaves special tokens (EOS, chat markers) out, as vLLM's default
    # None: no log-probabilities; k: each output token's, with the k most likely tokens at its position (`logprobs.py`)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for the prompt's own tokens (a forward of its own)
    # added to the target's logits before anything reads them (temperature, top-k / top-p, argmax, log-probabilities):
    # {token id: bias} or (id, bias) pairs, kept as sorted pairs; the distribution sampled is the biased one
    logit_bias: tuple[tuple[int, float], ...] = ()
    # penalties on tokens already in the text (vLLM's definitions, applied before the bias): a token seen in the
    # prompt or the output has a positive logit divided by repetition_penalty and a negative one multiplied by it;
    # then each logit loses frequency_penalty x its count in the output and presence_penalty if it occurs there
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # the output follows this grammar (`structured.py`): the constrained target's distribution is the one sampled
    structured: StructuredOutput | None = None
    # only these token ids may be produced (every other one's logit is -inf; vLLM's allowed_token_ids); () = all
    allowed_token_ids: tuple[int, ...] = ()
    # token sequences the output never completes (vLLM's bad_words, as the server tokenizes them): at each output
    # position the last token of every sequence whose other tokens end the output so far gets -inf (the prompt does
    # not count); a one-token sequence is never produced
    bad_words: tuple[tuple[int, ...], ...] = ()
    # the prefix cache's namespace (vLLM's cache_salt): a prompt finds cached pages only of prompts with the same salt
    # (None: those without one), so one tenant's requests cannot time what another's cached
    cache_salt: str | None = None

    def __post_init__(self):
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got {self.cache_salt!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not (isinstance(self.min_p, (int, float)) and not isinstance(self.min_p, bool) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                                ("repetition_penalty", 1e-3, 10.0)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high):
                raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((int(t), float(b)) for t, b in bias))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in bias) or len({t for t, _ in bias}) < len(bias):
            raise ValueError("logit_bias must map distinct token ids >= 0 to biases in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        if not (isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)
                and 0 <= self.min_tokens <= self.max_new_tokens):
            raise ValueError(f"min_tokens must be an integer in [0, max_new_tokens = {self.max_new_tokens}], got "
                             f"{self.min_tokens!r}")
        if self.min_tokens and self.structured is not None:
            raise ValueError("min_tokens cannot be combined with a structured output (its grammar decides where the "
                             "text may end)")
        try:
            allowed = tuple(sorted({int(t) for t in self.allowed_token_ids}))
        except (TypeError, ValueError):
            raise ValueError(f"allowed_token_ids must be token ids, got {self.allowed_token_ids!r}") from None
        if allowed and allowed[0] < 0:
            raise ValueError("allowed_token_ids must be token ids >= 0")
        if allowed and self.structured is not None:
            raise ValueError("allowed_token_ids cannot be combined with a structured output (the grammar decides which "
                             "tokens may come)")
        if allowed and self.min_tokens and set(allowed) <= set(int(t) for t in self.stop_token_ids):
            raise ValueError("allowed_token_ids are all stop ids, which min_tokens forbids at first: nothing could "
                             "be produced")
        object.__setattr__(self, "allowed_token_ids", allowed)
        try:
            bad_words = tuple(tuple(int(t) for t in word) for word in self.bad_words)
        except (TypeError, ValueError):
            raise ValueError(f"bad_words must be sequences of token ids, got {self.bad_words!r}") from None
        if any(not word or min(word) < 0 for word in bad_words):
            raise ValueError("bad_words must be non-empty sequences of token ids >= 0")
        if bad_words and self.structured is not None:
            raise ValueError("bad_words cannot be combined with a structured output (the grammar decides which tokens "
                             "may come)")
        if allowed and set(allowed) <= {word[0] for word in bad_words if len(word) == 1}:
            raise ValueError("bad_words ban every one of allowed_token_ids: nothing could be produced")
        object.__setattr__(self, "bad_words", bad_words)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if any((not isinstance(s, str)) or s == "" for s in self.stop_strings):
            raise ValueError("stop_strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def restricted(self) -> bool:
        """Whether top-k, top-p or min-p restrict the distribution (else it is softmax(logits / T) itself)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def target_probs(logits: torch.Tensor, temperature, top_p=1.0, top_k=0, min_p=0.0) -> torch.Tensor:
    """The distribution the target samples from: softmax(logits / T) restricted by min-p, then top-k, then top-p
    (vLLM's order; float32).

    temperature, top_p, top_k, min_p: numbers, or one per row of logits (sequences as long as its first dimension),
    so that rows of several requests go through each operation at once; each row's result is what it gets alone."""
    if logits.dim() == 1:
        return target_probs(logits[None], temperature, top_p, top_k, min_p)[0]
    scores = logits.float() / _by_row([max(t, 1e-6) for t in _per_row(temperature, logits)], logits)
    min_p = _per_row(min_p, logits)
    if any(m > 0 for m in min_p):  # below min_p x the likeliest token's probability (rows without min-p: below 0)
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * _by_row(min_p, probs), float("-inf"))
    vocab = scores.shape[-1]
    top_k = _per_row(top_k, logits)
    filtered = [k for k in set(top_k) if 0 < k < vocab]
    if filtered:  # below each row's k-th largest score (-inf for rows without top-k: nothing is below it)
        if all(k == filtered[0] for k in top_k):  # one k for every row
            cut = kth_largest(scores, filtered[0])
        else:
            cut = scores.new_full((*scores.shape[:-1], 1), float("-inf"))
            for k in filtered:
                idx = torch.tensor([r for r, rk in enumerate(top_k) if rk == k], device=scores.device)
                cut.index_copy_(0, idx, kth_largest(scores.index_select(0, idx), k))
        scores = fill_below(scores, cut, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    top_p = _per_row(top_p, logits)
    p_rows = [r for r, p in enumerate(top_p) if p < 1.0]
    if not p_rows:
        return probs
    if len(p_rows) == len(top_p):
        return _top_p(probs, _by_row(top_p, probs))
    idx = torch.tensor(p_rows, device=probs.device)
    return probs.index_copy(0, idx, _top_p(probs.index_select(0, idx), _by_row([top_p[r] for r in p_rows], probs)))


# rows of sampled logits `verify` hands `target_probs` at once: [16, 8192] float32, one row's verify at block 16
SAMPLED_ELEMENTS_AT_ONCE = 1 << 17

# top-p's cut is looked for among each row's this many most probable tokens first (a partition, then a sort of
# these alone); rows whose prefix reaches past them are sorted whole
TOP_P_CANDIDATES = 1024


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs restricted to the smallest prefix (largest first) whose mass reaches top_p, the token that crosses it
    included, and every token as probable as the prefix's last, renormalised: tied tokens are kept or dropped
    together, whatever order a sort put them in. Only the sorted values are needed (numpy sorts them ~20x faster
    than torch on CPU), and only as far as the prefix reaches. The mass before each place never decreases (a
    running sum of non-negative terms, less a non-increasing one), so the prefix's length is a binary search; a
    running sum's first m terms depend on the first m values only, so the m largest give the whole sort's answer
    wherever the prefix ends within them."""
    rows = probs.reshape(-1, probs.shape[-1])
    mass = top_p.expand(*probs.shape[:-1], 1).reshape(-1, 1).contiguous()

    def prefix_last(descending, mass):
        before = descending.cumsum(dim=-1) - descending
        length = torch.searchsorted(before, mass).clamp_min(1)  # a top_p below float32's range keeps the first
        return descending.gather(-1, length - 1), length

    m = TOP_P_CANDIDATES
    largest = largest_sorted(rows, m)  # the m largest, or the whole rows sorted
    cut, length = prefix_last(largest[:, :m], mass)
    if m < rows.shape[-1]:  # rows whose prefix reaches past the m largest: from the whole sort
        longer = (length[:, 0] >= m).nonzero()[:, 0]
        if len(longer):
            whole = largest[longer] if largest.shape[-1] == rows.shape[-1] else sort_descending(rows[longer])
            cut[longer] = prefix_last(whole, mass[longer])[0]
    kept = fill_below(rows, cut, 0.0)
    return (kept / kept.sum(dim=-1, keepdim=True)).view(probs.shape)


def _per_row(value, logits: torch.Tensor) -> list:
    """A number (numpy's and 0-d tensors too) as one per row of logits; a sequence as it is (its length checked)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if isinstance(value, numbers.Number):
        return [value] * logits.shape[0]
    value = list(value)
    if len(value) != logits.shape[0]:
        raise ValueError(f"{len(value)} sampling values for {logits.shape[0]} rows")
    return value


def _by_row(values: list, like: torch.Tensor) -> torch.Tensor:
    """One float32 value per row of `like`, shaped to broadcast over each row's [..., V]."""
    return torch.tensor(values, dtype=torch.float32, device=like.device).view(-1, *[1] * (like.dim() - 1))


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
    raced = [r for r, p in enumerate(params) if noise is not None and not p.greedy and not p.restricted]
    for rows, racing in ((greedy, False), (raced, True)):
        if not rows:
            continue
        pick = _row_picker(rows, device)
        logits = pick(target_logits)
        if racing:
            # the race on softmax(logits / T) as the argmax of logits - T log E: the form the screened read-out
            # computes (`greedy_readout.py`), so both paths pick by the same expression
            temperatures = torch.tensor([max(params[r].temperature, 1e-6) for r in rows], device=device)
            chosen = argmax(logits.float() + race_offsets(pick(noise), temperatures))
        else:
            chosen = argmax(logits)
        verdict = accept_chosen(chosen, pick(draft_tokens))
        if len(rows) == b:
            return verdict
        num_accepted[rows], next_tokens[rows] = verdict.num_accepted, verdict.next_tokens
    done = set(raced)
    rest = [r for r in range(b) if not params[r].greedy and r not in done]
    if noise is not None:
        # the target's own token at every block position (the winner of its race under the row's noise, on p
        # restricted by top-k / top-p): accept drafts while they equal it, then commit it. Rows go through
        # `target_probs` together, as many at once as fit a core's cache (a whole 16-row verify at once ran
        # 1.4-1.7x slower than row by row, out of cache; one-token steps of 16 rows ~2x faster at once)
        per_call = max(1, SAMPLED_ELEMENTS_AT_ONCE // (target_logits.shape[1] * target_logits.shape[2]))
        for start in range(0, len(rest), per_call):
            rows = rest[start:start + per_call]
            pick = _row_picker(rows, device)
            together = [params[r] for r in rows]
            probs = target_probs(pick(target_logits), [p.temperature for p in together], [p.top_p for p in together],
                                 [p.top_k for p in together], [p.min_p for p in together])
            verdict = accept_chosen(race(probs, pick(noise)), pick(draft_tokens))
            num_accepted[rows], next_tokens[rows] = verdict.num_accepted, verdict.next_tokens
        return Verdict(num_accepted, next_tokens)
    for row in rest:
        p = params[row]
        probs = target_probs(target_logits[row], p.temperature, p.top_p, p.top_k, p.min_p)  # [k+1, V]
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


def _row_picker(rows: list[int], device):
    """Takes rows `rows` (ascending) of a tensor's first dimension: a view where they are consecutive (all rows,
    usually), else a gather."""
    if rows[-1] - rows[0] == len(rows) - 1:
        return lambda t: t[rows[0]:rows[-1] + 1]
    idx = torch.tensor(rows, device=device)
    return lambda t: t.index_select(0, idx)


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
            probs = target_probs(target_logits[row], p.temperature, p.top_p, p.top_k, p.min_p)
            chosen = race(probs, noise[row].index_select(0, depths[row])).tolist().__getitem__
        else:
            gen = generators[row] if generators else None

            def chosen(node, row=row, p=p, gen=gen):  # the target's own sample at the node, drawn when reached
                probs = target_probs(target_logits[row, node], p.temperature, p.top_p, p.top_k, p.min_p)
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
