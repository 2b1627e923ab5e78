"""The lossless generation engine: prefill, then cycles of propose -> target forward -> verify -> commit.

One cycle for a batch of rows (`SpecEngine._cycle`; docs/design.md, 'Decode cycle'):
0. plan            the draft policy (`policy.py`) gives each row a verify width w: the bonus + w - 1 drafts, or
                   w = 1, a one-token step without a draft;
1. propose         the drafting method fills `[bonus, d_1 .. d_k]` at positions `n .. n+k` (k = block_size - 1)
                   for the rows that draft (and takes in every row's newly committed features); where a row's
                   context repeats, prompt lookup continues its chain (`lookup.py`);
2. target forward  the target runs once over the rows' blocks with its KV cache (`target_kv.py`), capturing the
                   tapped layers' features: each row its own width on the eager fast path (ragged: the tokens
                   packed, attention per width; the prompts of requests joining in this `step` ride along),
                   padded to the widest elsewhere;
3. verify          the shared verifier (`verify.py`) returns per row the accepted count a < w and the next token;
4. commit          tokens `d_1..d_a, next` are appended; block slots `0..a` stay in the target cache, the rest are
                   rolled back (a no-op on the paged fast path, a crop plus masked holes on the generic path);
                   the kept slots' features become the drafter's next context; the policy sees the acceptance and
                   the cycle's measured costs; finished rows leave the batch.
Before a cycle each row's caches take pages (`EngineConfig.kv_page_size` positions each) for its next block
(`Batch.grow`): memory follows the tokens each row holds, not the longest row's or max_tokens.
Block size 1 with `NoProposer` is plain autoregressive decoding through the same code: the baseline every
speedup is measured against.

Llama / Mistral / Qwen2 / Qwen3 / Phi-3 / Gemma 1-3 targets and the mixtures of experts Mixtral, Qwen2-MoE,
Qwen3-MoE, gpt-oss run through `FastTarget` (lean forward, paged per-row cache; `fast_path_unsupported` says why another
does not); any other transformers decoder that accepts `position_ids` and a 2D attention mask runs through
transformers itself.
On CPU both run their widest projections through oneDNN on packed weight copies (`pack_weights`, `cpu_linear.py`).
`compile=True` compiles the per-cycle draft step and target block forward (fast path only; `compiled.py`); the
paged caches then hold a power-of-two row count (`batch.RowBuckets`), so requests joining and leaving reuse a
handful of graphs, and all rows share one width (1 or the block). `exact=True` makes the target forward
batch-invariant (`fast_target.py`).
Limitation of the generic path: with batch > 1, targets whose attention uses a sliding window count cache slots
(holes included) rather than tokens, so they are exact only while the context fits the window.

What this module does not know about: how drafts are made (`proposers.py`), how they are judged (`verify.py`),
how many tokens to verify (`policy.py`), row padding (`batch.py`, inside the paged caches), HTTP, or continuous
batching (the server drives `SpecEngine` one cycle at a time through `open_batch`, `add`, `step`, `cancel`, and
`preempt` / `resume` to stay within a memory budget).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from flashdraft.engine.batch import (Batch, Features, PendingContext, RowBuckets, next_power_of_two, take_pending,
                                     width_groups)
from flashdraft.engine.compiled import compile_step, compile_unavailable
from flashdraft.engine.config import EngineConfig
from flashdraft.engine.detokenize import IncrementalText
from flashdraft.engine.kernels import attention_scope, in_attention_scope
from flashdraft.engine.logprobs import TokenLogprob, prompt_logprobs, token_logprobs
from flashdraft.engine.lookup import NgramIndex, splice
from flashdraft.engine.profile import CycleProfiler
from flashdraft.engine.noise import exponential_noise, race_offsets, random_seed
from flashdraft.engine.prefix_cache import NO_HIT, PrefixCache, PrefixHit
from flashdraft.engine.policy import SETTLED, AcceptancePriors, CostModel, CycleTiming, new_policy, width_choices
from flashdraft.engine.proposers import DFlashProposer, NoProposer, ProposalInput
from flashdraft.engine.structured import GrammarCompiler, RowGrammar
from flashdraft.engine.target_kv import DynamicTargetKV, PagedTargetKV
from flashdraft.engine.tree import (AUTO_TREE_SIZES, TREE_CANDIDATES, RowTree, ShapeChoice, TreeCalibration, add_branch,
                                    best_first, lookup_continuation, stack, tree_attention_mask)
from flashdraft.engine.verify import SamplingParams, accept_chosen, sample_tokens, verify, verify_tree
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.cpu_linear import pack_by_default, require_packable
from flashdraft.model.fast_target import (FastTarget, SoftCapped, fast_path_unsupported, packable_weights,
                                         untraceable_experts, uses_long_rope)
from flashdraft.model.greedy_readout import ScreenedArgmax, screening_pays, screening_unavailable
from flashdraft.model.slots import KVBudget
from flashdraft.model.target import TargetModel, validate_pair

# the noise thread (`SpecEngine._noise_soon`) takes a cycle's noise from this many values (positions x vocabulary) on:
# below it the thread cost the target's forward more than the noise it made, by taking the interpreter's lock
# between the forward's many small operations (shipped pair, one torch thread on 2 cores, plain decoding at T = 1:
# +0.4 ms a step at 1 row of vocabulary 8192, 0.97x at 4 rows, 1.01x at 8 and 16, 1.07x at 32, 1.16x at 64;
# docs/bench/noise_thread/noise_thread.py)
NOISE_THREAD_MIN_VALUES = 1 << 17
# sampled rows hash the noise of up to NOISE_AHEAD positions at once, as many as keep a cycle's fresh noise within
# NOISE_AHEAD_VALUES values (positions x vocabulary x sampled rows), and reuse it at the next steps (`_noise`): a
# call's cost is mostly fixed and cache-cold after the forward (one row of vocabulary 8192 on this CPU: 362 us for
# one position, 812 us for 16), so one row at one-token steps paid ~5 % of its step for noise it now pays once in 16
NOISE_AHEAD, NOISE_AHEAD_VALUES = 16, 1 << 17
# a row's target features pending for the drafter (it writes them when the row drafts) are written regardless
# once they reach this many positions: the memory a row that keeps stepping holds for them stays bounded
PENDING_CONTEXT_LIMIT = 256
# timed cycles of each verify width per row bucket in `warmup`: the first of a size is not kept, the rest settle it
PROFILE_CYCLES = 1 + SETTLED
# a row's features for the prefix cache's next page of its answer are views of the cycles' kept features (which its
# pending drafter context holds too); past this many they are gathered into one copy, so a row holds the features of
# at most this many cycles, not of every cycle until its page fills (64 cycles at one-token steps)
PAGE_TAIL_VIEWS = 4
CONTEXT_PROFILE_LENGTHS = (16, 64, 256)  # pending context per row timed in `warmup` (the last: PENDING_CONTEXT_LIMIT)


@dataclass
class RequestStats:
    """Acceptance and timing of one request. Acceptance length per cycle = accepted drafts + 1 (the bonus)."""

    block_size: int
    prompt_tokens: int
    output_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    plain_steps: int = 0  # one-token steps without a draft (the draft policy's choice); not in the acceptance figures
    verify_widths: list[int] = field(default_factory=list)  # tokens verified by each drafting cycle (bonus included)
    # positions the drafter filled in each drafting cycle (bonus included): the cycle's widest width, or the block
    draft_lengths: list[int] = field(default_factory=list)
    lookup_splices: int = 0  # drafting cycles whose chain was continued by prompt lookup (`lookup.py`)
    # one-token steps that verified a prompt-lookup continuation instead (`lookup_steps`): how many, the continuation
    # tokens they verified and those accepted. Not in the acceptance figures, which are the drafter's
    lookup_steps: int = 0
    lookup_drafts: int = 0
    lookup_accepted: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache gave (`prefix_cache.py`), not computed
    time_to_first_token: float = 0.0
    decode_time: float = 0.0

    @property
    def tau(self) -> float:
        """Mean acceptance length over drafting cycles (vLLM's 'mean acceptance length' = 1 + accepted / drafts);
        1.0 for a request that never drafted (each step committed one token)."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 1.0

    @property
    def num_drafts(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(a - 1 for a in self.acceptance_lengths)

    @property
    def drafted_tokens(self) -> int:
        """Draft tokens the verifier judged (a drafting cycle of width w judges w - 1)."""
        return sum(w - 1 for w in self.verify_widths)

    @property
    def proposed_tokens(self) -> int:
        """Draft tokens the drafter proposed (verified or not: a row may verify a prefix of its cycle's draft)."""
        return sum(d - 1 for d in self.draft_lengths)

    @property
    def verified_tokens(self) -> int:
        """Tokens through the target's decoding forwards: drafting cycles' widths, one-token steps and the lookup
        continuations verified beside them."""
        return sum(self.verify_widths) + self.plain_steps + self.lookup_steps + self.lookup_drafts

    @property
    def histogram(self) -> list[int]:
        """histogram[i] = number of cycles whose acceptance length was i + 1 (1 .. block_size)."""
        hist = [0] * self.block_size
        for a in self.acceptance_lengths:
            hist[a - 1] += 1
        return hist

    @property
    def per_position_acceptance(self) -> list[float]:
        """Rate at which draft position i (1 .. block_size - 1) was accepted, over all cycles."""
        n = len(self.acceptance_lengths)
        return [sum(a > i for a in self.acceptance_lengths) / n if n else 0.0 for i in range(1, self.block_size)]

    @property
    def tokens_per_second(self) -> float:
        total = self.time_to_first_token + self.decode_time
        return self.output_tokens / total if total > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "block_size": self.block_size,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "tau": round(self.tau, 4),
            "num_drafts": self.num_drafts,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_lengths": list(self.acceptance_lengths),
            "plain_steps": self.plain_steps,
            "verify_widths": list(self.verify_widths),
            "drafted_tokens": self.drafted_tokens,
            "lookup_splices": self.lookup_splices,
            "lookup_steps": self.lookup_steps,
            "lookup_drafts": self.lookup_drafts,
            "lookup_accepted": self.lookup_accepted,
            "proposed_tokens": self.proposed_tokens,
            "verified_tokens": self.verified_tokens,
            "acceptance_histogram": self.histogram,
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "time_to_first_token_s": round(self.time_to_first_token, 6),
            "decode_time_s": round(self.decode_time, 6),
            "tokens_per_second": round(self.tokens_per_second, 3),
        }


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (stop token or string) or "length"
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, if the request asked (`logprobs.py`)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (None first), if asked


@dataclass
class StreamEvent:
    """New output of one request after a cycle. `text` is the newly decodable text (None without a tokenizer)."""

    index: int
    token_ids: list[int]
    text: str | None
    finished: bool
    result: GenerationResult | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, if the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on a request's first event, if it asked


@dataclass
class _Row:
    index: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    stats: RequestStats
    output: list[int] = field(default_factory=list)
    n_cached: int = 0  # tokens of this row in the target cache = position of the bonus token
    bonus: int = 0
    finish_reason: str | None = None
    stop_token: bool = False  # ended by a stop id (or its grammar's end): that token's text is left out of the text
    detok: IncrementalText | None = None  # the output's text (with a tokenizer), decoded incrementally
    emitted_tokens: int = 0
    started: float = 0.0
    reported: bool = False
    acceptance: object = None  # the draft policy's estimates for this row (`policy.RowAcceptance`)
    noise_seed: int = 0  # counter-based sampling noise (`noise.py`): the request's seed, or a random one
    noise_cache: tuple[int, torch.Tensor] | None = None  # (first output position, noise [w, V]) of the last window
    pending: PendingContext = field(default_factory=PendingContext)  # target features the drafter has not read
    lookup: NgramIndex | None = None  # where the row's n-grams last ended, for `lookup_splice` and `lookup_steps`
    logprobs: list[TokenLogprob] | None = None  # one per output token, for a request that asks (`params.logprobs`)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # `params.prompt_logprobs`: one per prompt token
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # `params.logit_bias` as (token ids, biases)
    refused: torch.Tensor | None = None  # [V] True for the ids outside `params.allowed_token_ids`
    grammar: RowGrammar | None = None  # `params.structured`: where the output stands in its grammar
    # the prefix cache (`prefix_cache.py`): where the row's chain of cached pages ends (None: it does not go on), how
    # many full pages it covers, and the target features of the positions after them (views), for the next page
    prefix_end: object = None
    prefix_pages: int = 0
    page_tail: list[torch.Tensor] = field(default_factory=list)
    long_rope: bool = False  # a LongRoPE target's cache recomputed with the long frequencies (`_cross_long_rope`)

    def cached_noise(self, width: int) -> torch.Tensor | None:
        """The noise of output positions len(output) .. +width that the last window already covered (those past
        its accepted drafts), or None. The noise of a position never changes, so it is reused, not hashed again:
        at low acceptance nearly all of a drafting row's window."""
        if self.noise_cache is None:
            return None
        start, cached = self.noise_cache
        first = len(self.output)
        return cached[first - start: first - start + width] if start <= first < start + cached.shape[0] else None

    @property
    def history(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class Seating:
    """Rows whose prompts ride a cycle's forward (`SpecEngine._seat`): their drafter state, one prompt group per row
    for `forward_ragged`, their prefix-cache hits (None without a cache), their first row in the target cache."""

    state: object
    prompts: list
    hits: list[PrefixHit] | None
    first: int


def _wants_logprobs(rows: Sequence[_Row]) -> bool:
    return any(r.logprobs is not None for r in rows)


def _processes_logits(r: _Row) -> bool:
    return (r.bias is not None or r.refused is not None or r.params.penalized or r.grammar is not None
            or bool(r.params.bad_words) or len(r.output) < r.params.min_tokens)


def _reads_logits(rows: Sequence[_Row]) -> bool:
    """Rows whose cycles need the target's logits themselves (log-probabilities, a logit bias, penalties, a
    structured output): such a cycle keeps the full read-out and verifies chains."""
    return any(r.logprobs is not None or _processes_logits(r) for r in rows)


def _process_logits(rows: Sequence[_Row], members: Sequence[int], logits: torch.Tensor,
                    block: torch.Tensor | None = None) -> torch.Tensor:
    """logits [g, w, V] of rows `members` (in place) with each one's penalties, then its logit bias, then -inf on
    the ids outside its allowed ones, on the bad words' last tokens where they would complete one and on its stop ids
    at the positions of output tokens before `min_tokens`, then its grammar's mask. Position t of a
    row's logits follows its block's tokens 0..t (block [b, >= w]; None: w = 1, nothing drafted), so the tokens a
    penalty or a bad word counts there are its output and its drafts 1..t, and its grammar stands after them: the
    target's distribution given that text, which is what the verifier must judge draft t + 1 against."""
    for j, i in enumerate(members):
        r = rows[i]
        if r.params.penalized:
            _penalize(r, logits[j], None if block is None else block[i, 1:logits.shape[1]])
        if r.bias is not None:
            ids, values = r.bias
            logits[j, ..., ids] += values.to(logits.dtype)
        if r.refused is not None:
            logits[j].masked_fill_(r.refused, float("-inf"))
        if r.params.bad_words:
            _ban_bad_words(r, logits[j], [] if block is None else block[i, 1:logits.shape[1]].tolist())
        early = r.params.min_tokens - len(r.output)  # block positions choosing output tokens before min_tokens
        if early > 0 and r.params.stop_token_ids:
            logits[j, :early, list(r.params.stop_token_ids)] = float("-inf")
        if r.grammar is not None:
            w = logits.shape[1]
            allowed = r.grammar.masks([] if block is None else block[i, 1:w].tolist(), w)
            logits[j].masked_fill_(~allowed.to(logits.device), float("-inf"))
    return logits


def _refused(allowed: tuple[int, ...], vocab: int, device) -> torch.Tensor | None:
    """[V] True for the ids outside `allowed` (None: every id allowed)."""
    if not allowed:
        return None
    refused = torch.ones(vocab, dtype=torch.bool, device=device)
    refused[list(allowed)] = False
    return refused


def _ban_bad_words(r: _Row, logits: torch.Tensor, drafts: list[int]) -> None:
    """logits [w, V] (in place): at position t, -inf on the last token of every bad word whose other tokens end the
    output followed by drafts[:t] (vLLM's rule: the output only, not the prompt)."""
    text = r.output + drafts
    for t in range(logits.shape[0]):
        end = len(r.output) + t  # the tokens before position t's choice: text[:end]
        for word in r.params.bad_words:
            k = len(word) - 1
            if k <= end and tuple(text[end - k:end]) == word[:-1]:
                logits[t, word[-1]] = float("-inf")


def _penalize(r: _Row, logits: torch.Tensor, drafts: torch.Tensor | None) -> None:
    """logits [w, V] (in place): the row's repetition, frequency and presence penalties (`SamplingParams`), with
    position t counting its output and drafts[:t] (drafts [w - 1] or None). Only the tokens the text holds change, so
    only their columns are read and written ([w, tokens seen], not [w, V]: a block at 152k would be 2.4M counts)."""
    p, dev = r.params, logits.device
    drafted = drafts.tolist() if drafts is not None else []
    repeats = p.repetition_penalty != 1.0
    ids = sorted(set(r.output).union(drafted, r.prompt if repeats else ()))
    if not ids:
        return
    column = {t: k for k, t in enumerate(ids)}
    counts = torch.bincount(torch.tensor([column[t] for t in r.output], dtype=torch.long, device=dev),
                            minlength=len(ids))[None]
    if drafted:
        steps = torch.nn.functional.one_hot(torch.tensor([column[t] for t in drafted], device=dev), len(ids))
        counts = torch.cat([counts, counts + steps.cumsum(0)])
    cols = torch.tensor(ids, device=dev)
    values = logits[:, cols]
    if repeats:
        in_prompt = torch.zeros(len(ids), dtype=torch.bool, device=dev)
        in_prompt[[column[t] for t in set(r.prompt)]] = True
        values = torch.where((counts > 0) | in_prompt, torch.where(values > 0, values / p.repetition_penalty,
                                                                    values * p.repetition_penalty), values)
    if p.frequency_penalty:
        values = values - p.frequency_penalty * counts.to(values.dtype)
    if p.presence_penalty:
        values = values - p.presence_penalty * (counts > 0).to(values.dtype)
    logits[:, cols] = values


def _committed_logprobs(rows: list[_Row], groups, logits, block: torch.Tensor, accepted: list[int],
                        next_tokens: list[int]) -> dict[int, list[TokenLogprob]] | None:
    """Per row that asks for log-probabilities, its committed tokens' (accepted drafts, then the target's own),
    from its width group's logits [g, w, V] (`_target_forward`); None when no row asks. One log-softmax over the
    committed positions of every row that asks."""
    if not _wants_logprobs(rows):
        return None
    picked, tokens, asking = [], [], []
    for (w, idx), group_logits in zip(groups, logits):
        slots = []
        for j, i in enumerate(idx.tolist()):
            if rows[i].logprobs is not None:
                a = accepted[i]
                slots += range(j * w, j * w + a + 1)
                tokens += block[i, 1:1 + a].tolist() + [next_tokens[i]]
                asking.append(i)
        if slots:
            flat = group_logits.reshape(-1, group_logits.shape[-1])
            picked.append(flat.index_select(0, torch.tensor(slots, device=flat.device)))
    most = max(rows[i].params.logprobs for i in asking)
    entries = token_logprobs(torch.cat(picked), tokens, most)
    out, start = {}, 0
    for i in asking:
        n, k = accepted[i] + 1, rows[i].params.logprobs
        mine = entries[start:start + n]
        out[i] = mine if k == most else [replace(e, top=e.top[:k]) for e in mine]
        start += n
    return out


def _group_noise(noise: list[torch.Tensor] | None, members: list[int], width: int) -> torch.Tensor | None:
    """The noise [g, width, V] of a width group's rows (`SpecEngine._noise` windows), or None without noise."""
    return None if noise is None else torch.stack([noise[i][:width] for i in members])


class SpecEngine:
    """Speculative generation for a transformers target with a drafting method (DFlash by default).

    engine = SpecEngine(target_model, drafter, tokenizer)
    results = engine.generate([ids_a, ids_b], SamplingParams(max_new_tokens=64))
    for event in engine.stream([ids], params): ...
    engine.close()  # or `with SpecEngine(...) as engine:`; takes the engine's capture hooks off the target
    """

    def __init__(
        self,
        target: nn.Module | TargetModel,
        drafter: DFlashDraftModel | None = None,
        tokenizer=None,
        config: EngineConfig | None = None,
        *,
        proposer=None,
        **options,
    ):
        """`config` says how to run (`EngineConfig`); keyword `options` override its fields. `proposer` replaces
        the DFlash drafter with another drafting method (`proposers.py`)."""
        config = replace(config or EngineConfig(), **options)
        self.config = config
        block_size, compile, pack_weights, exact = config.block_size, config.compile, config.pack_weights, config.exact
        self._closed = False
        # a module gets a TargetModel of this engine's own, whose hooks `close` removes; a TargetModel passed in
        # (shared, e.g. the trainer's) gets back the layer ids it had
        self._owns_target = not isinstance(target, TargetModel)
        self._restore_layer_ids: list[int] | None = None
        self.target = target if isinstance(target, TargetModel) else TargetModel(target)
        self.drafter = drafter
        self.tokenizer = tokenizer
        # CUDA: the engine's attention calls without cuDNN's backend unless asked for (`kernels.py`)
        self._attention_scope = attention_scope(self.target.device, config.cudnn_attention)
        self._grammar_compiler: GrammarCompiler | None = None  # built at the first structured request
        # the lean paged-cache path for the families FastTarget knows (None = use it when the model supports it)
        reason = fast_path_unsupported(self.target.model)
        fast_path = config.fast_path
        if fast_path and reason:
            raise ValueError(f"fast_path=True but {reason}")
        use_fast = fast_path is not False and reason is None
        if not use_fast and uses_long_rope(self.target.model):
            warnings.warn("a LongRoPE target on the generic path: past original_max_position_embeddings its output "
                          "differs from its own generate (which recomputes the cache there; the fast path does too)",
                          stacklevel=2)
        # CPU: the target's wide projections and the drafter's read-out through oneDNN on packed weight copies
        # (`cpu_linear.py`; None = when all are packable and the copies stay small; the drafter's read-out is one
        # more copy of the lm_head)
        packable = (packable_weights(self.target.model) if use_fast else []) + [self.target.lm_head.weight]
        pack_draft = pack_weights  # None: the drafter's read-out is measured apart (`DFlashProposer`)
        if pack_weights is None:
            pack_weights = pack_by_default(packable)
        elif pack_weights:
            require_packable(packable)
        self.pack_weights = pack_weights
        # exact: a batch-invariant target forward, so drafting never changes a single bit of the output
        if exact and not use_fast:
            raise ValueError(f"exact=True needs the fast target path (Llama/Mistral/Qwen2/Qwen3), and {reason}")
        self.exact = exact
        self.fast = FastTarget(self.target, pack_weights, exact=exact) if use_fast else None
        if proposer is not None:
            self.proposer = proposer
        elif drafter is not None and (block_size is None or block_size > 1):
            validate_pair(drafter, self.target)
            if not self._owns_target:
                self._restore_layer_ids = list(self.target.layer_ids)
            self.target.set_layer_ids(drafter.target_layer_ids)
            self.proposer = DFlashProposer(drafter, self.target, compile=compile, pack_weights=pack_draft)
            if config.walk_candidates is not None and hasattr(self.proposer, "walk_candidates"):
                self.proposer.walk_candidates = config.walk_candidates
        else:
            self.proposer = NoProposer()
        if self.fast is not None:  # after the proposer: the drafter's bf16 read-out may be the copy it reads through
            self.fast.screened = self._screened(config, use_fast)
        if isinstance(self.proposer, NoProposer):
            self.block_size = 1
        else:
            self.block_size = int(block_size or getattr(drafter, "block_size", 16))
        # compiled draft and verify steps (static shapes per block size; CUDA graphs on GPU)
        self.block_step = None  # the compiled target block forward
        if compile:
            why_not = compile_unavailable(self.target.device) or (
                f"compile=True needs the fast target path, and {reason}" if self.fast is None else None
            ) or untraceable_experts(self.target.model)
            if why_not:
                raise ValueError(why_not)
            self.block_step = compile_step(self.fast.forward, self.target.device)
        self.buckets = RowBuckets(bucketed=compile)  # compiled steps see power-of-two row counts
        # the draft policy's shared memory: measured cycle costs and the acceptance priors of new rows (`policy.py`);
        # rows verify their own widths in one forward on the eager fast path, else all rows share one width
        self.costs = CostModel()
        self.acceptance_priors = AcceptancePriors(self.block_size)
        self.ragged = self.fast is not None and self.block_step is None
        # verifies of greedy rows and raced sampled rows return the target's choices, not its logits (`_chooses`)
        self.screens_readout = self.fast is not None and self.fast.screened is not None and self.block_step is None
        # token trees (`tree.py`): the eager fast path verifies them; elsewhere rows verify the chain
        self.tree_budget = config.tree_budget if self.block_size > 1 else 0
        # prompt lookup continuing drafters' chains (`lookup.py`): min n-gram length, 0 = off (and without drafts)
        self.lookup_splice = config.lookup_splice if self.block_size > 1 else 0
        # rows at one-token steps verifying prompt lookup's continuation (`AdaptiveWidth.lookup_widths`): min
        # n-gram length, 0 = off. Rows verify their own widths only on the ragged path
        self.lookup_steps = config.lookup_steps if self.block_size > 1 and self.ragged else 0
        # an eager drafter drafts only as far as the widest row verifies (bonus + w - 1 masked positions, not the
        # whole block): a block of 4 costs a third of one of 16 at 16 rows on CPU, for 1-3 % fewer accepted drafts
        # than the first 3 of a full block's. Then narrower blocks are worth offering (`policy.width_choices`); where
        # every draft is a full block (compiled drafting graphs, fixed-size token trees) a row verifies the block or
        # takes a one-token step: narrower blocks cost nearly as much and measured 5-9 % slower at batch 1
        self._compiled_drafts = getattr(self.proposer, "compiled", False)  # graphs that write context as they draft
        self.drafts_to_width = self.block_size > 1 and not self._compiled_drafts and self.tree_budget in (0, "auto")
        self.width_choices = width_choices(self.block_size) if self.drafts_to_width else (1, self.block_size)
        # drafting rows' verifies trimmed after the draft by the drafter's confidence in each draft (`policy.trim`):
        # the adaptive policy on ragged eager verification, with a drafter that reports it
        self.confidence_trim = (config.confidence_trim and config.draft_policy == "adaptive" and self.ragged
                                and self.drafts_to_width and hasattr(self.proposer, "drafted_confidence"))
        if self.confidence_trim:
            self.proposer.confidence = True
        why_no_trees = (("compiled steps verify one width" if self.block_step is not None else None)
                        or ("the generic target path has no tree attention" if self.fast is None else None)
                        or ("exact mode attends by position" if exact else None)
                        or (None if hasattr(self.proposer, "propose_candidates") else
                            f"{type(self.proposer).__name__} proposes no candidates"))
        if self.tree_budget and why_no_trees:
            warnings.warn(f"tree_budget={self.tree_budget!r} ignored, rows verify the chain: {why_no_trees}",
                          stacklevel=2)
            self.tree_budget = 0
        if config.lookup_ngram and not self.tree_budget and self.block_size > 1:
            warnings.warn("lookup_ngram ignored: the prompt-lookup branch is part of a token tree (tree_budget)",
                          stacklevel=2)
        # the tree sizes "auto" chooses among: the chain's width first
        self.tree_sizes = (self.block_size,) + tuple(n for n in AUTO_TREE_SIZES if n > self.block_size)
        self.tree_calibration = TreeCalibration(self.tree_sizes)
        self.tree_shape = ShapeChoice()  # "auto": trees or the chain, by what each has measured
        self.tree_costs = CostModel()  # "auto": what tree cycles cost (their machinery included), by tokens verified
        self._feature_spec = None  # (width, dtype, device) of the target features the drafter reads
        self.profiler = CycleProfiler(config.profile)
        # called with a dict after every decode cycle (`_trace`): what the draft policy chose and what it gave, for
        # a server's `--cycle-trace` (None: nothing is built)
        self.cycle_trace: Callable[[dict], None] | None = None
        self.max_positions = getattr(self.target.config, "max_position_embeddings", None)
        # pages a cache's pool may grow to, or a `KVBudget` every cache shares (a server's memory budget)
        self.kv_page_limit: int | KVBudget | None = None
        # automatic prefix caching (`prefix_cache.py`): prompts' full pages kept for later prompts that start alike
        self.prefix_cache: PrefixCache | None = None
        if config.prefix_cache_tokens:
            why_not = ("the generic target path" if self.fast is None else
                       "exact mode computes each prompt whole" if exact else None)
            if why_not:
                warnings.warn(f"prefix_cache_tokens={config.prefix_cache_tokens} ignored: {why_not}", stacklevel=2)
            else:
                self.prefix_cache = PrefixCache(config.kv_page_size, -(-config.prefix_cache_tokens
                                                                       // config.kv_page_size))
        self._noise_worker: ThreadPoolExecutor | None | bool = False  # `_noise_thread`; False: not decided yet

    def _screened(self, config: EngineConfig, use_fast: bool) -> ScreenedArgmax | None:
        """The argmax read-out (greedy rows, raced sampled rows) through a bf16 copy of the target's lm_head
        (`greedy_readout.py`), or None: asked for (`screen_greedy=True`: where it cannot run, an error), or by
        default where it runs on a CPU with native bf16."""
        why_not = (("it needs the fast target path" if not use_fast else None)
                   or ("exact mode keeps its per-token products" if config.exact else None)
                   or ("compiled steps keep the full read-out" if config.compile else None)
                   or ("the target soft-caps its logits" if isinstance(self.fast.lm_head, SoftCapped) else None)
                   or screening_unavailable(self.target.lm_head))
        if config.screen_greedy is False or (why_not and config.screen_greedy is None):
            return None
        if why_not:
            raise ValueError(f"screen_greedy=True but {why_not}")
        if config.screen_greedy is None and not screening_pays():
            return None
        # the drafter reads out through a bf16 copy of the same lm_head (unless it has its own): share it, one copy
        # less in memory and in the caches every cycle
        read_out = getattr(self.proposer, "lm_head", None)
        shared = (read_out if self.drafter is not None and getattr(self.drafter, "lm_head", None) is None
                  and read_out is not None and read_out.weight.dtype == torch.bfloat16
                  and read_out.weight.shape == self.target.lm_head.weight.shape else None)
        return ScreenedArgmax(self.target.lm_head, low=shared, full=self.fast.lm_head)  # (packed where it pays)

    @property
    def target_path(self) -> str:
        """Which forward the target runs: "fast target path", or the generic one and why (`fast_path_unsupported`)."""
        if self.fast is not None:
            return "fast target path"
        return f"generic target path: {fast_path_unsupported(self.target.model) or 'fast_path=False'}"

    @property
    def scratch_slots(self) -> int:
        """Cache slots past a row's committed tokens that one cycle may write: its block, or its tree's nodes."""
        if not self.tree_budget:
            return self.block_size
        nodes = self.tree_sizes[-1] if self.tree_budget == "auto" else self.tree_budget + 1
        lookup_nodes = self.block_size - 1 if self.config.lookup_ngram else 0
        return max(self.block_size, nodes + lookup_nodes)

    # ---- lifetime -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Take the forward hooks this engine put on the target off it (a shared `TargetModel` gets back the
        layer ids it had) and drop what the engine built: packed weight copies, compiled steps, the drafting
        method. Idempotent; afterwards the engine refuses to run. Engines built per evaluation must be closed,
        or their hooks pile up on the target."""
        if self._closed:
            return
        self._closed = True
        if self._owns_target:
            self.target.remove_hooks()
        elif self._restore_layer_ids is not None:
            self.target.set_layer_ids(self._restore_layer_ids)
        self.fast = self.block_step = self.proposer = None
        if self._noise_worker:
            self._noise_worker.shutdown(wait=False)

    def __enter__(self) -> "SpecEngine":
        self._check_open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # an engine dropped without close(): its own TargetModel's hooks go with it (never a shared one's ids)
        try:
            if not getattr(self, "_closed", True) and self._owns_target:
                self.target.remove_hooks()
        except Exception:
            pass

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this SpecEngine was closed (close() or the end of its `with` block); build a new one")

    # ---- public API -----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[Sequence[int]] | torch.Tensor, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        results: list[GenerationResult | None] = [None] * len(prompts)
        for event in self.stream(prompts, params):
            if event.finished:
                results[event.index] = event.result
        return results  # type: ignore[return-value]

    def stream(
        self, prompts: Sequence[Sequence[int]] | torch.Tensor, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> Iterator[StreamEvent]:
        """Run the batch to completion, yielding each request's new tokens (and text) after every cycle."""
        batch = self.open_batch()
        yield from self.add(batch, prompts, params)
        while batch.rows:
            yield from self.step(batch)

    @torch.inference_mode()
    @in_attention_scope
    def warmup(self, max_batch_size: int = 1) -> list[int]:
        """Get ready for batches of up to `max_batch_size` rows before the first request. At each row bucket (the
        compiled buckets; eager: powers of two and `max_batch_size`) throwaway rows run one cycle of every verify
        width a cycle may use, which builds the compiled graphs, then `PROFILE_CYCLES` more of each, timed into the
        draft policy's cost model, and eager drafters time writing 16-256 positions of pending context per row
        (`_time_context_writes`). The first requests are then planned from measured costs: without this the
        policy drafts blind to measure them (at 16 rows on CPU two full-block cycles, each ~8 one-token steps'
        time). The graphs take any cache size (pool pages and page-table width are dynamic dimensions), so longer
        requests compile nothing more. Returns the buckets warmed ([] for eager plain decoding: nothing to plan or
        compile)."""
        self._check_open()
        if self.block_step is None and self.block_size <= 1:
            return []
        sizes = range(1, max_batch_size + 1)
        if self.block_step is not None:
            buckets = sorted({self.buckets.rows(n) for n in sizes})
        else:  # eager steps take any row count; the cost curves interpolate between powers of two
            buckets = sorted({min(next_power_of_two(n), max_batch_size) for n in sizes})
        # enough tokens for every warm-up cycle of every width, should every draft be accepted
        params = SamplingParams(max_new_tokens=(PROFILE_CYCLES + 1) * sum(self.width_choices) + 2)
        prompt = [0] * (self.block_size + 1)  # longer than a block: the drafter's context write runs alone too
        prefix_cache, self.prefix_cache = self.prefix_cache, None  # throwaway prompts are not kept
        try:
            self._warm_buckets(buckets, prompt, params)
        finally:
            self.prefix_cache = prefix_cache
        return buckets

    def _warm_buckets(self, buckets: list[int], prompt: list[int], params: SamplingParams) -> None:
        for rows in buckets:
            batch = self.open_batch()
            self.add(batch, [prompt] * rows, params)
            for width in self.width_choices:
                for i in range(PROFILE_CYCLES + 1):  # the first builds the graphs and is not timed
                    if batch.rows:
                        self._cycle(batch, forced_width=width, profile=i > 0)
            while batch.rows and self.block_step is not None:  # compiled: the rows' last steps too
                self.step(batch)
            self._time_context_writes(rows)

    def _time_context_writes(self, rows: int) -> None:
        """Time writing pending context of a few lengths, up to `PENDING_CONTEXT_LIMIT` per row, for `rows` rows into
        a throwaway drafter cache (eager drafting writes it apart before a draft, and the policy prices drafts by
        it; the cycles above only write a block's worth). Compiled drafting writes context inside its graphs."""
        if self._compiled_drafts or not self.proposer.needs_features or self._feature_spec is None:
            return
        width, dtype, device = self._feature_spec
        idx = torch.arange(rows, device=device)
        for length in CONTEXT_PROFILE_LENGTHS:
            state = self._new_proposer_state()
            state.grow([length] * rows)
            features = Features(torch.zeros(rows, length, width, dtype=dtype, device=device),
                                torch.arange(length, device=device).expand(rows, -1),
                                torch.ones(rows, length, dtype=torch.bool, device=device))
            for i in range(3):  # the first builds the kernels for the shape and is not timed
                started = self._clock()
                self.proposer.absorb(state, features, self.block_size, idx)
                if i:
                    self.costs.context.record(rows * length, self._clock() - started)

    # ---- continuous batching: a live batch that requests join and leave between cycles ------------------------

    def open_batch(self) -> Batch:
        """An empty live batch; requests join with `add` and advance with `step`."""
        self._check_open()
        return self._new_batch()

    def _new_batch(self, **fields) -> Batch:
        return Batch(proposer_state=self._new_proposer_state(),
                     block_size=self.scratch_slots,
                     policy=new_policy(self.config.draft_policy, self.block_size, self.costs, self.ragged,
                                       self.acceptance_priors, self.width_choices, self.drafts_to_width),
                     **fields)

    def _new_proposer_state(self):
        return self.proposer.new_batch_state(self.buckets, self.config.kv_page_size, self.kv_page_limit)

    @torch.inference_mode()
    @in_attention_scope
    def add(
        self, batch: "Batch", prompts: Sequence[Sequence[int]] | torch.Tensor,
        params: SamplingParams | Sequence[SamplingParams] | None = None, request_ids: Sequence | None = None,
    ) -> list[StreamEvent]:
        """Prefill new requests and merge them into `batch`; returns their first-token events.

        Events carry `index` = the request id given (default: the position in `prompts`).
        """
        self._check_open()
        return self._add_rows(batch, self._make_rows(prompts, params, request_ids))

    def _add_rows(self, batch: "Batch", rows: list[_Row]) -> list[StreamEvent]:
        self._score_prompts(rows)
        for r in rows:
            r.acceptance = batch.policy.new_row(sampled=not r.params.greedy)
        for group in self._after_their_start(rows):
            if group:
                batch.merge(self._prefill(group))
        return list(self._events(rows))

    def _after_their_start(self, rows: Sequence[_Row]) -> tuple[list[_Row], list[_Row]]:
        """(rows, []) without a prefix cache; with one, (the others, rows whose first full page an earlier row of
        the same admission starts with too, under the same salt): the second are prefilled after the first, so
        they find the pages they share in the cache instead of computing them beside it (a request's n choices,
        requests with one system prompt arriving together)."""
        if self.prefix_cache is None:
            return list(rows), []
        size, seen, first, later = self.prefix_cache.page_size, set(), [], []
        for r in rows:
            salt = self._prefix_salt(r, r.prompt)
            key = (tuple(r.prompt[:size]), salt)
            shares = (len(r.prompt) > size and key in seen  # and what it shares is not cached already
                      and not self.prefix_cache.cached_tokens(r.prompt[:size + 1], salt))
            (later if shares else first).append(r)
            seen.add(key)
        return first, later

    @torch.inference_mode()
    @in_attention_scope
    def step(
        self, batch: "Batch", prompts: Sequence[Sequence[int]] | None = None,
        params: SamplingParams | Sequence[SamplingParams] | None = None, request_ids: Sequence | None = None,
    ) -> list[StreamEvent]:
        """One draft/verify cycle for every row of the batch; finished rows leave it.

        Requests given here join the batch in this cycle (checked before anything runs: a bad one raises
        ValueError and changes nothing). Where they can (`rides_cycle`), their prompts go through the cycle's
        target forward beside the rows' blocks, and they come out of it with their first token, as from `add`:
        one forward instead of a prefill forward of their own first (a lone 37-token prompt's prefill took ~10 ms
        on CPU against ~6.5 ms per prompt when 16 were prefilled together, and every running row waited for it).
        Otherwise they are prefilled first (`add`) and take part in the cycle.
        """
        self._check_open()
        joining = self._make_rows(prompts, params, request_ids) if prompts is not None else []
        events, later = [], []
        if joining and self.rides_cycle(batch, joining):  # those sharing an earlier one's start join after it
            joining, later = self._after_their_start(joining)
        elif joining:
            events, joining = self._add_rows(batch, joining), []
        self._score_prompts(joining)
        for r in joining:
            r.acceptance = batch.policy.new_row(sampled=not r.params.greedy)
            r.started = time.perf_counter()
        rows = list(batch.rows)
        if rows:
            self._cycle(batch, joining=joining)
        events += list(self._events(rows + joining))
        return events + (self._add_rows(batch, later) if later else [])

    def _score_prompts(self, rows: Sequence[_Row]) -> None:
        """New rows that ask for their prompt's log-probabilities get them (a forward of their own, `logprobs.py`),
        one forward per distinct prompt and figure count: the n choices of a request share it."""
        scored: dict[tuple, list] = {}
        for r in rows:
            if r.params.prompt_logprobs is not None:
                key = (tuple(r.prompt), r.params.prompt_logprobs)
                if key not in scored:
                    scored[key] = prompt_logprobs(self.target, r.prompt, r.params.prompt_logprobs)
                r.prompt_logprobs = scored[key]

    def check(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
              ) -> None:
        """Raise ValueError, as `add` and `step` would before running anything, if these requests cannot run."""
        self._make_rows(prompts, params)

    def rides_cycle(self, batch: "Batch", rows: Sequence) -> bool:
        """Whether requests joining `batch` in `step` (anything with a `prompt`) ride its cycle's target forward:
        there are rows to ride with, the cycle is one ragged forward (eager fast path, no trees), not exact
        (batch-invariant prefill runs each prompt alone), and the prompts hold at most `mixed_prefill_tokens` tokens
        in all."""
        return (bool(batch.rows) and self.ragged and not self.exact and not self.tree_budget
                and sum(map(self.tokens_to_compute, rows)) <= self.config.mixed_prefill_tokens)

    def tokens_to_compute(self, request) -> int:
        """Tokens of a request's prompt (anything with `prompt` and `params`) a prefill would compute now: those
        after what the prefix cache holds of it."""
        cached = (self.prefix_cache.cached_tokens(request.prompt, self._prefix_salt(request, request.prompt))
                  if self.prefix_cache is not None else 0)
        return len(request.prompt) - cached

    def cancel(self, batch: "Batch", request_id) -> bool:
        """Drop a request from the batch now (e.g. its client went away), freeing its cache rows."""
        for r in batch.rows:
            if r.index == request_id:
                r.finish_reason = "abort"
                r.reported = True
                self._drop_finished(batch)
                return True
        return False

    def preempt(self, batch: "Batch", request_id) -> object | None:
        """Take a running request out of the batch, freeing its cache rows, with everything it has generated kept
        (the server's memory budget needs the room): the returned state goes back in with `resume`. None if the
        request is not in the batch."""
        for i, r in enumerate(batch.rows):
            if r.index == request_id:
                self._keep_rows(batch, [j for j in range(len(batch.rows)) if j != i])
                return r
        return None

    @torch.inference_mode()
    @in_attention_scope
    def resume(self, batch: "Batch", preempted: Sequence) -> None:
        """Bring preempted requests back into `batch`: each one's prompt and output so far are prefilled again
        (recompute; in exact mode the output positions through the exact forward, as they were first computed),
        and it goes on from the token it had sampled last, with its sampling state (seeded noise, generator) as it
        was, so the output is the one it would have produced uninterrupted. Emits nothing: no new tokens."""
        self._check_open()
        if preempted:
            batch.merge(self._prefill(list(preempted), resume=True))

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids: the tokenizer's, then the target's generation config's (one or a list)."""
        ids = []
        gen = getattr(getattr(self.target, "model", None), "generation_config", None)
        for x in (getattr(self.tokenizer, "eos_token_id", None), getattr(gen, "eos_token_id", None)):
            for t in (x if isinstance(x, (list, tuple)) else [x]):
                if t is not None and int(t) not in ids:
                    ids.append(int(t))
        return ids

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured outputs (`SamplingParams.structured`) for this engine's tokenizer; `check` refuses
        a constraint before it is queued."""
        if self._grammar_compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs a tokenizer: pass tokenizer= to SpecEngine")
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.target.vocab_size, self.eos_token_ids)
        return self._grammar_compiler

    # ---- setup ----------------------------------------------------------------------------------------------

    def _make_rows(self, prompts, params, request_ids=None) -> list[_Row]:
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]
        prompts = [list(map(int, p)) for p in prompts]
        if not prompts:
            raise ValueError("no prompts given")
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if request_ids is None:
            request_ids = list(range(len(prompts)))
        vocab = self.target.vocab_size
        rows = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not prompt:
                raise ValueError(f"prompt {i} is empty; give at least one token (e.g. a BOS token)")
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
            if p.stop_strings and self.tokenizer is None:
                raise ValueError("stop_strings need a tokenizer: pass tokenizer= to SpecEngine")
            if p.logit_bias and p.logit_bias[-1][0] >= vocab:
                raise ValueError(f"request {i}: logit_bias has token id {p.logit_bias[-1][0]}, outside the vocabulary "
                                 f"[0, {vocab})")
            if p.allowed_token_ids and p.allowed_token_ids[-1] >= vocab:
                raise ValueError(f"request {i}: allowed_token_ids has token id {p.allowed_token_ids[-1]}, outside the "
                                 f"vocabulary [0, {vocab})")
            if p.bad_words and max(max(word) for word in p.bad_words) >= vocab:
                raise ValueError(f"request {i}: bad_words has a token id outside the vocabulary [0, {vocab})")
            if self.max_positions and len(prompt) + p.max_new_tokens > self.max_positions:
                raise ValueError(
                    f"prompt {i}: {len(prompt)} prompt tokens + max_new_tokens {p.max_new_tokens} exceed the "
                    f"target's context of {self.max_positions} positions"
                )
            gen = None
            if p.seed is not None and self.config.sampler == "rejection":
                gen = torch.Generator(device=self.target.device).manual_seed(int(p.seed))
            rows.append(_Row(request_ids[i], prompt, p, gen, RequestStats(self.block_size, len(prompt)),
                             noise_seed=int(p.seed) if p.seed is not None else random_seed(),
                             lookup=NgramIndex(min(n for n in (self.lookup_splice, self.lookup_steps) if n))
                             if self.lookup_splice or self.lookup_steps else None,
                             logprobs=None if p.logprobs is None else [],
                             bias=(torch.tensor([t for t, _ in p.logit_bias], device=self.target.device),
                                   torch.tensor([b for _, b in p.logit_bias], device=self.target.device))
                             if p.logit_bias else None,
                             refused=_refused(p.allowed_token_ids, vocab, self.target.device),
                             grammar=self.grammars.matcher(p.structured) if p.structured is not None else None))
        return rows

    def _prefill(self, rows: list[_Row], resume: bool = False) -> Batch:
        """The rows' prompts (resumed rows: their committed tokens) into fresh caches sized for them plus a block,
        in chunks; new rows sample their first token."""
        start = time.perf_counter()
        prompts = [r.history[:r.n_cached] for r in rows] if resume else [r.prompt for r in rows]
        capture = self.proposer.needs_features
        lengths = [len(p) + self.scratch_slots for p in prompts]  # pages for the prompt and the first block
        hits = self._prefix_hits(rows, prompts, count=not resume)
        if self.fast is not None:
            kv, logits, features = PagedTargetKV.prefill(self.fast, prompts, capture, lengths,
                                                         self.config.kv_page_size, self.buckets, self.block_step,
                                                         max_pages=self.kv_page_limit,
                                                         exact_from=[len(r.prompt) for r in rows] if resume else None,
                                                         cached=hits and (self.prefix_cache, hits))
            features = self._cache_prompts(kv.kv, range(len(rows)), rows, prompts, hits, features, resume)
        else:
            kv, logits, features = DynamicTargetKV.prefill(self.target, prompts, capture)
        if resume:  # each row's next token (its bonus) was sampled before it was preempted
            return self._prefilled_batch(rows, kv, features, lengths)
        for r in rows:
            r.started = start
        self._first_tokens(rows, logits)
        batch = self._prefilled_batch(rows, kv, features, lengths)
        self._drop_finished(batch)
        return batch

    def _prefix_hits(self, rows: Sequence[_Row], prompts: Sequence[Sequence[int]], count: bool = True
                     ) -> list[PrefixHit] | None:
        """Each prompt's cached start (None without a prefix cache); with `count`, new rows learn how many of their
        prompt tokens it gave (a resumed row's recompute is not its prompt's)."""
        if self.prefix_cache is None:
            return None
        hits = [self.prefix_cache.match(p, self._prefix_salt(r, p, not count)) for r, p in zip(rows, prompts)]
        if count:
            for r, hit in zip(rows, hits):
                r.stats.cached_tokens = hit.tokens
        return hits

    def _prefix_salt(self, request, prompt: Sequence[int], resumed: bool = False):
        """The prefix-cache salt `prompt` (a request's prompt, or a `resumed` row's committed tokens) is prefilled
        under: the request's own, and for a LongRoPE target the frequency set of that prefill (`LongRope`: long
        where the sequence, with a resumed row's pending token, outgrows the original length), so pages of the two
        sets never meet. A row's chain then holds one set: a row recomputed long at the boundary
        (`_cross_long_rope`) goes on in a long chain from its recompute."""
        salt = request.params.cache_salt
        if self.fast is None or self.fast.long_rope is None:
            return salt
        return salt, len(prompt) + resumed > self.fast.long_rope.original

    def _cache_prompts(self, kv, kv_rows: Sequence[int], rows: Sequence[_Row], prompts: Sequence[Sequence[int]],
                       hits: list[PrefixHit] | None, features: list[torch.Tensor] | None,
                       resumed: bool = False) -> list[torch.Tensor] | None:
        """After a forward computed prompts (the positions after their hits) into rows `kv_rows` of `kv` (a
        PagedKV): each prompt's whole features (its hit's, then the forward's: `features`), and its full pages into
        the prefix cache (under each row's salt), where the row's output pages follow as they fill
        (`_cache_output_pages`)."""
        if hits is None:
            return features
        if features is not None:
            features = [f if not hit.slots else torch.cat([self.prefix_cache.prefix_features(hit), f])
                        for hit, f in zip(hits, features)]
        ends = self.prefix_cache.insert(kv, kv_rows, prompts, features,
                                        [self._prefix_salt(r, p, resumed) for r, p in zip(rows, prompts)])
        size = self.prefix_cache.page_size
        for i, (r, prompt, end) in enumerate(zip(rows, prompts, ends)):
            r.prefix_end, r.prefix_pages = end, len(prompt) // size
            # a copy: a view would hold the prefill's whole features until the row's first output page fills
            r.page_tail = [features[i][r.prefix_pages * size:].clone()] if features is not None else []
        return features

    def _cache_output_pages(self, batch: Batch, kept: list[torch.Tensor] | None) -> None:
        """After a commit: each row's newly committed positions (`kept`: their target features, per row) and the
        pages of its output they fill go into the prefix cache, after its prompt's, so a later prompt that holds the
        conversation so far (a chat's next turn) finds it."""
        size = self.prefix_cache.page_size
        for i, r in enumerate(batch.rows):
            if r.prefix_end is None:
                continue
            if kept is not None:
                r.page_tail.append(kept[i])
                if len(r.page_tail) > PAGE_TAIL_VIEWS:  # views hold their cycles' features: gather them now
                    r.page_tail = [torch.cat(r.page_tail)]
            full = min(r.n_cached, len(r.prompt) + len(r.output)) // size
            if full <= r.prefix_pages:
                continue
            tail, n = (torch.cat(r.page_tail) if kept is not None else None), (full - r.prefix_pages) * size
            r.prefix_end = self.prefix_cache.extend(batch.kv.kv, i, r.prefix_end, r.history[:full * size],
                                                    r.prefix_pages, None if tail is None else tail[:n])
            r.prefix_pages = full
            r.page_tail = [tail[n:]] if tail is not None and r.prefix_end is not None else []

    def _prefilled_batch(self, rows: list[_Row], kv, features: list[torch.Tensor] | None, lengths: list[int]) -> Batch:
        """`features`: each row's prompt features [n, F] (positions 0 .. n - 1), or None."""
        batch = self._new_batch(rows=list(rows), kv=kv)
        batch.grow(lengths)
        if features is not None:
            self._pend_prompts(batch, rows, features)
        return batch

    def _first_tokens(self, rows: Sequence[_Row], logits: torch.Tensor) -> None:
        """New rows' first tokens, sampled from their prompts' last logits [n, V]: each row's bonus and its first
        output token."""
        noise = self._noise(rows, [1] * len(rows))
        if any(_processes_logits(r) for r in rows):
            logits = _process_logits(rows, range(len(rows)), logits.clone()[:, None])[:, 0]
        first = sample_tokens(logits, [r.params for r in rows], [r.generator for r in rows],
                              torch.stack(noise) if noise is not None else None).tolist()
        now = time.perf_counter()
        for i, (r, token) in enumerate(zip(rows, first)):
            r.n_cached = len(r.prompt)
            r.bonus = token
            r.stats.time_to_first_token = now - r.started
            self._append(r, [token], None if r.logprobs is None else token_logprobs(logits[i:i + 1], [token],
                                                                                     r.params.logprobs))

    def _pend_prompts(self, batch: Batch, rows: Sequence[_Row], values: list[torch.Tensor]) -> None:
        """Each new row's prompt features [n, F] (positions 0 .. n - 1) wait for its first draft; long ones are
        written now. A resumed row's drafter context is rebuilt the same way, from its prefill."""
        self._feature_spec = (values[0].shape[-1], values[0].dtype, values[0].device)
        for r, row_values in zip(rows, values):
            r.pending = PendingContext()
            r.pending.add(row_values, 0)
        self._write_long_pending(batch)

    def _write_long_pending(self, batch: Batch) -> None:
        """Rows whose pending context reached `PENDING_CONTEXT_LIMIT` positions write it to the drafter now (compiled
        steps write every row's: they take every row at once)."""
        rows = batch.rows
        long = [i for i, r in enumerate(rows) if r.pending.length >= PENDING_CONTEXT_LIMIT]
        if not long:
            return
        if self.block_step is not None:
            long = list(range(len(rows)))
        features = take_pending([rows[i].pending for i in long], *self._feature_spec)
        idx = torch.tensor(long, device=self.target.device) if self.block_step is None else None
        self.proposer.absorb(batch.proposer_state, features, self.block_size, idx)

    # ---- one cycle ------------------------------------------------------------------------------------------

    def _cycle(self, batch: Batch, forced_width: int | None = None, profile: bool = False,
               joining: Sequence[_Row] = ()) -> None:
        """plan -> propose -> target forward -> verify -> commit, for every live row at once. `forced_width`: every
        row verifies that width and nothing is learnt from the cycle but, with `profile`, its costs. `joining`: new
        rows whose prompts the target forward prefills beside the blocks (`step`); they join after the commit,
        and the cycle's time, which includes their prefill, is not learnt from."""
        if self.fast is not None and self.fast.long_rope is not None and forced_width is None:
            self._cross_long_rope(batch)
        rows, prof, started = batch.rows, self.profiler, time.perf_counter()
        prof.start()
        batch.grow()  # every row's caches take pages for the positions its block (or tree) may reach
        limit = self.config.disable_by_batch_size
        capped = forced_width is None and 0 < limit < len(rows)  # a load drafting is off at: one-token steps
        widths = ([forced_width] * len(rows) if forced_width is not None else [1] * len(rows) if capped
                  else batch.policy.widths([r.acceptance for r in rows], [r.pending.length for r in rows]))
        short_of = self._long_rope_room(rows)  # LongRoPE: rows whose verify must end before the original length
        if short_of and not self.ragged:  # one width for every row (compiled steps draft every row or none)
            short_of = dict.fromkeys(range(len(rows)), min(short_of.values()))
        if short_of:
            widths = [min(w, short_of.get(i, w)) for i, w in enumerate(widths)]
        drafting = [i for i, w in enumerate(widths) if w > 1]
        trees = bool(self.tree_budget and drafting) and not _reads_logits(rows) and not short_of and (
            self.tree_budget != "auto" or forced_width is not None or self.tree_shape.use_trees(len(rows)))
        # positions the drafter fills: trees grow from a whole block's candidates
        draft_width = max(widths) if self.drafts_to_width and not trees else self.block_size
        # rows at one-token steps that verify a prompt-lookup continuation instead: {row: continuation}
        copies, searched = (({}, ()) if trees or forced_width is not None or capped
                            else self._lookup_copies(batch, widths))
        verified = [1 + len(copies[i]) if i in copies else w for i, w in enumerate(widths)] if copies else widths
        if short_of and copies:
            verified = [min(v, short_of.get(i, v)) for i, v in enumerate(verified)]
        # sampled rows' counter-based noise at the output positions their draft and verify cover (a Future where
        # no sampled row drafts: it is made on another core while the target runs, `_noise_soon`)
        noise = self._noise_soon(rows, [draft_width if w > 1 else v for w, v in zip(widths, verified)], widths, trees)
        if trees:  # drafting rows verify token trees (`tree.py`), as chains from here on
            block, features, verified, accepted, next_tokens, drafted_at = self._tree_step(batch, drafting, noise)
            context = (0, 0.0)  # trees write the drafting rows' context inside their draft, untimed apart
            logprobs = None  # no row asks: trees are off in cycles of rows that do (or process their logits)
        else:
            block, positions, draft_probs, context, confidence = self._propose(
                batch, drafting, max(verified), draft_width, None if isinstance(noise, Future) else noise, copies)
            if confidence and forced_width is None and hasattr(batch.policy, "trim"):  # each drafting row verifies
                verified = batch.policy.trim([r.acceptance for r in rows], verified, confidence,  # as far as its
                                             len(drafting) * draft_width)  # drafts' confidence pays
                block, positions = block[:, :max(verified)], positions[:, :max(verified)]
            drafted_at = self._clock()
            prof.mark("draft")
            groups = width_groups(verified, block.device)
            seated = self._seat(batch, joining) if joining else None
            logits, features, prompt_outputs = self._target_forward(batch, block, positions, groups,
                                                                    seated.prompts if seated else (), noise)
            prof.mark("target")
            if any(_processes_logits(r) for r in rows):
                for (_, idx), group_logits in zip(groups, logits):
                    _process_logits(rows, idx.tolist(), group_logits, block)
            if isinstance(noise, Future):
                noise = noise.result()
            accepted, next_tokens = self._verify(rows, groups, logits, block, drafting, draft_probs, noise)
            logprobs = _committed_logprobs(rows, groups, logits, block, accepted, next_tokens)
            prof.mark("verify")
        self._commit_block(batch, block, features, verified, accepted, next_tokens, draft_width, copies, set(drafting),
                           logprobs)
        if joining:
            self._join(batch, joining, seated, prompt_outputs)
        prof.mark("commit")
        context_tokens, context_s = context
        timing = CycleTiming(sum(verified) if self.ragged else len(rows) * max(widths), len(drafting) * draft_width,
                             drafted_at - started - context_s, time.perf_counter() - started, context_tokens, context_s,
                             lookup_tokens=sum(len(c) for c in copies.values()))
        if forced_width is None:
            auto_shape = self.tree_budget == "auto" and bool(drafting)
            if auto_shape:
                self.tree_shape.observe(len(rows), trees, len(rows) + sum(accepted), timing.total_s)
                if trees:  # "auto" sizes trees by their own costs; the policy prices drafting by the chain's
                    self.tree_costs.record(timing)
            batch.policy.observe([r.acceptance for r in rows], widths, accepted,
                                 None if (auto_shape and trees) or joining else timing)
            if copies:
                batch.policy.observe_lookups([rows[i].acceptance for i in copies], [verified[i] for i in copies],
                                             [accepted[i] for i in copies])
            if searched and hasattr(batch.policy, "observe_searches"):
                rows_searched, search_s = searched
                batch.policy.observe_searches([rows[i].acceptance for i in rows_searched],
                                              [accepted[i] if i in copies else 0 for i in rows_searched], search_s)
            if self.cycle_trace is not None:
                self._trace(rows, widths, accepted, len(joining), trees, timing,
                            "capped" if capped else getattr(batch.policy, "decision", None),
                            [verified[i] for i in copies])
        elif profile and not trees:
            self.costs.record(timing)
        self._drop_finished(batch)

    def _trace(self, rows: list[_Row], widths: list[int], accepted: list[int], joined: int, trees: bool,
               timing: CycleTiming, decision: str | None, lookups: list[int]) -> None:
        """One cycle's record for `cycle_trace`: per row its request id, the policy's width (1: a one-token step)
        and drafts accepted; requests that joined in it (their prefill is in its time), whether it verified trees,
        how the draft policy decided (`AdaptiveWidth.decision`: e.g. "held" while the goodput check holds the load
        at one-token steps; "capped": more rows than `disable_by_batch_size`, the policy not asked), the tokens
        verified by each one-token step that verified a lookup continuation (`lookup_steps`, in row order), and its
        time in ms (the draft's and the pending context write's apart)."""
        self.cycle_trace({"time": time.time(), "requests": [r.index for r in rows], "widths": list(widths),
                          "accepted": [int(a) for a in accepted], "joined": joined, "trees": trees,
                          "lookups": lookups,
                          "decision": decision, "ms": round(1000 * timing.total_s, 3),
                          "draft_ms": round(1000 * timing.draft_s, 3),
                          "context_ms": round(1000 * timing.context_s, 3)})

    def _long_rope_room(self, rows: list[_Row]) -> dict[int, int]:
        """LongRoPE targets (`fast_target.LongRope`): {row: the widest verify it may run} for rows whose cache holds
        the short frequencies. Their block's positions stay below `original_max_position_embeddings` (the logits
        there come from the short set; past it, from a cache recomputed with the long one: `_cross_long_rope`)."""
        if self.fast is None or self.fast.long_rope is None:
            return {}
        original = self.fast.long_rope.original
        return {i: original - r.n_cached for i, r in enumerate(rows)
                if not r.long_rope and r.n_cached < original < r.n_cached + self.block_size}

    def _cross_long_rope(self, batch: "Batch") -> None:
        """Rows of a LongRoPE target whose next token is the first past `original_max_position_embeddings`: their
        cache is recomputed with the long frequencies, as the model's own `generate` recomputes it at that step
        (Phi-3's `prepare_inputs_for_generation`), by taking them out and prefilling them again (`preempt` /
        `resume`: the sequence, with its pending token, is then longer than the original length)."""
        original = self.fast.long_rope.original
        for r in batch.rows:  # prefilled past the original length: long from the start
            r.long_rope = r.long_rope or r.n_cached > original
        crossing = [r for r in batch.rows if not r.long_rope and r.n_cached >= original]
        if crossing:
            parked = [self.preempt(batch, r.index) for r in crossing]
            self.resume(batch, parked)
            for r in crossing:
                r.long_rope = True

    def _clock(self) -> float:
        """Now, after the device's queued work (the policy's cost model times the draft apart)."""
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)
        return time.perf_counter()

    def _noise_thread(self) -> ThreadPoolExecutor | None:
        """The thread that makes noise during target forwards (`EngineConfig.noise_thread`), decided at the first
        sampled cycle (a server's scheduler sets torch's threads in its own thread after the engine is built).
        None on a GPU (the noise is made there, queued behind the forward) and, by default, where torch's threads
        already use every core the process may run on: a second thread would take its time from theirs."""
        if self._noise_worker is False:
            wanted = self.config.noise_thread
            if wanted is None:
                cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
                wanted = torch.get_num_threads() < cores
            self._noise_worker = (ThreadPoolExecutor(1, "flashdraft-noise", torch.set_num_threads, (1,))
                                  if wanted and self.target.device.type == "cpu" else None)
        return self._noise_worker

    def _noise_soon(self, rows: list[_Row], widths: list[int], planned: list[int], trees: bool):
        """`_noise(rows, widths)`, or its Future where the noise thread runs and no sampled row drafts (`planned`
        widths > 1): the noise is then read only by the target's read-out and the verifier, after the layers."""
        sampled = [not r.params.greedy for r in rows]
        values = sum(w for s, w in zip(sampled, widths) if s) * self.target.vocab_size
        if (self.config.sampler != "gumbel" or values < NOISE_THREAD_MIN_VALUES or trees
                or any(s and w > 1 for s, w in zip(sampled, planned)) or self._noise_thread() is None):
            return self._noise(rows, widths)
        return self._noise_worker.submit(self._noise, list(rows), list(widths))

    def _noise(self, rows: list[_Row], widths: list[int]) -> list[torch.Tensor] | None:
        """Exponential noise [w, V] of each row's next w output positions (ones for greedy rows); None when every
        row is greedy or the sampler is rejection sampling."""
        sampled = [not r.params.greedy for r in rows]
        if self.config.sampler != "gumbel" or not any(sampled):
            return None
        dev, vocab = self.target.device, self.target.vocab_size
        ones = {w: torch.ones(w, vocab, device=dev) for w, s in zip(widths, sampled) if not s}  # one per width
        windows = [None if s else ones[w] for s, w in zip(sampled, widths)]
        ahead = min(NOISE_AHEAD, NOISE_AHEAD_VALUES // (sum(sampled) * vocab))  # positions a fresh window covers
        reused = {i: rows[i].cached_noise(max(w, ahead)) for i, (s, w) in enumerate(zip(sampled, widths)) if s}
        have = {i: 0 if cached is None else cached.shape[0] for i, cached in reused.items()}  # positions cached
        by_count: dict[int, list[int]] = {}  # fresh positions -> rows: one hash call for all rows of a count
        for i, cached in reused.items():
            if have[i] >= widths[i]:  # the window a former call hashed ahead covers this one
                windows[i] = cached[:widths[i]]
            else:
                by_count.setdefault(max(widths[i], ahead) - have[i], []).append(i)
        for fresh, idx in by_count.items():
            seeds = torch.tensor([rows[i].noise_seed for i in idx])  # host integers: the keys are hashed there
            starts = torch.tensor([len(rows[i].output) + have[i] for i in idx])
            noise = exponential_noise(seeds, starts, fresh, vocab, device=dev)
            for j, i in enumerate(idx):
                window = noise[j] if reused[i] is None else torch.cat([reused[i], noise[j]])
                rows[i].noise_cache = (len(rows[i].output), window)
                windows[i] = window[:widths[i]]
        return windows

    def _propose(self, batch: Batch, drafting: list[int], width: int, draft_width: int,
                 noise: list[torch.Tensor] | None, copies: dict[int, list[int]]):
        """Each row's block `[bonus, d_1 .. d_{width-1}]` at its next positions (rows that do not draft: the bonus,
        then their lookup continuation in `copies` or filler that is never verified), and the drafts'
        distributions (None: one-hot drafts), drafted as a block of `draft_width` >= `width` positions; (positions,
        seconds) of the pending context written apart first (eager drafters: the policy prices that write by its
        size, rows x the longest pending); and with `confidence_trim`, {drafting row: the drafter's confidence in
        each of its drafts} (rows whose chain prompt lookup continued are left out: their drafts are not the
        drafter's), else None."""
        rows, dev = batch.rows, self.target.device
        bonus = torch.tensor([r.bonus for r in rows], dtype=torch.long, device=dev)
        n_cached = torch.tensor([r.n_cached for r in rows], dtype=torch.long, device=dev)
        positions = n_cached[:, None] + torch.arange(width, device=dev)[None]
        context = (0, 0.0)
        if not drafting and not copies:
            return bonus[:, None], positions, None, context, None
        block = torch.zeros(len(rows), width, dtype=torch.long, device=dev)
        block[:, 0] = bonus
        for i, copy in copies.items():
            block[i, 1:1 + len(copy)] = torch.tensor(copy, dtype=torch.long)
        if not drafting:
            return block, positions, None, context, None
        inp = self._proposal_input(batch, drafting, noise, draft_width)
        written = inp.new_features
        if written is not None and written.values.shape[1] and not self._compiled_drafts:
            write_started = self._clock()
            self.proposer.absorb(batch.proposer_state, written, draft_width, inp.draft_rows)
            context = (written.values.shape[0] * written.values.shape[1], self._clock() - write_started)
            inp.new_features = Features(*(t[:, :0] for t in written.astuple()))  # written: nothing left to write
        constrained = hasattr(self.proposer, "keep_scores") and any(rows[i].grammar is not None for i in drafting)
        if hasattr(self.proposer, "keep_scores"):
            self.proposer.keep_scores = constrained
        drafts, draft_probs = self.proposer.propose(batch.proposer_state, inp, draft_width)
        drafted = min(width, draft_width) - 1  # a lookup continuation may run past the widest drafting row
        if inp.draft_rows is None:
            block[:, 1:1 + drafted] = drafts[:, :drafted]
        else:
            block[inp.draft_rows, 1:1 + drafted] = drafts[:, :drafted]
        spliced = []
        if self.lookup_splice and draft_probs is None and drafted > 1:  # drafts with a q keep the drafter's tokens
            spliced = self._splice_lookups(rows, drafting, block[:, :1 + drafted])
        if constrained and draft_probs is None:  # drafts with a q must stay the q's samples
            self._constrain_drafts(rows, drafting, block[:, :1 + drafted], noise)
        confidence = self.proposer.drafted_confidence() if self.confidence_trim else None
        if confidence is not None:
            confidence = {i: c for i, c in zip(drafting, confidence[:, :drafted].float().cpu().numpy())
                          if i not in spliced}
        return block, positions, draft_probs, context, confidence

    def _constrain_drafts(self, rows: list[_Row], drafting: list[int], block: torch.Tensor,
                          noise: list[torch.Tensor] | None) -> None:
        """The drafts in `block` [b, 1 + k] (in place) of drafting rows whose text follows a grammar, walked through
        it (`RowGrammar.constrain`): a refused draft becomes its position's best allowed token by the drafter's own
        logits (sampled rows: its race, log q - log E under the row's noise), so the drafter's guess survives the
        grammar instead of being rejected for it. Drafts are suggestions: the verifier alone decides the text."""
        scores = self.proposer.drafted_scores()
        if scores is None:  # compiled drafts keep no logits
            return
        k = block.shape[1] - 1
        for j, i in enumerate(drafting):
            r = rows[i]
            if r.grammar is None:
                continue
            row_scores = scores[j, :k].float()
            if not r.params.greedy and noise is not None:
                row_scores = torch.log_softmax(row_scores / r.params.temperature, dim=-1) - noise[i][:k].log()
            block[i, 1:] = torch.tensor(r.grammar.constrain(block[i, 1:].tolist(), row_scores), device=block.device)

    def _lookup_copies(self, batch: Batch, widths: list[int]
                       ) -> tuple[dict[int, list[int]], tuple[list[int], float] | tuple[()]]:
        """Rows the policy left at one-token steps whose context's last `lookup_steps` or more tokens occurred
        before: the tokens that followed, as many as the policy prices worth verifying
        (`AdaptiveWidth.lookup_widths`) and the request can still use. ({row: continuation}, (rows searched, the
        search's seconds) or ()). Sampled rows too: the verifier accepts a copied token where it is the target's
        own sample there (under the noise, its race winner; with rejection sampling, with probability p(token), a
        one-hot draft)."""
        price = getattr(batch.policy, "lookup_widths", None)
        if not self.lookup_steps or price is None:
            return {}, ()
        rows = batch.rows
        # rows at one-token steps with room for a copy (drafts past the request's end commit nothing) whose copies
        # could pay (the others skip the search)
        room = {i: rows[i].params.max_new_tokens - len(rows[i].output) - 1 for i, w in enumerate(widths) if w == 1}
        candidates = [i for i, n in room.items() if n > 0]
        worth = batch.policy.worth_looking_up([rows[i].acceptance for i in candidates], widths) if candidates else []
        searched = [i for i, search in zip(candidates, worth) if search]
        found, started = {}, time.perf_counter()
        for i in searched:
            r = rows[i]
            r.lookup.extend(r.prompt, r.output)
            copy = r.lookup.continuation(min(room[i], self.block_size - 1), self.lookup_steps)
            if copy:
                found[i] = copy
        search = (searched, time.perf_counter() - started) if searched else ()
        if not found:
            return {}, search
        lengths = price([rows[i].acceptance for i in found], [len(c) for c in found.values()], widths)
        return {i: copy[:n] for (i, copy), n in zip(found.items(), lengths) if n}, search

    def _splice_lookups(self, rows: list[_Row], drafting: list[int], block: torch.Tensor) -> set[int]:
        """Drafting rows whose context's last tokens occurred before: their chain continued by what followed, where
        that starts with the drafter's first draft (`lookup.py`). Returns the rows continued."""
        chains, continued = block[drafting, 1:].tolist(), set()
        for i, drafts in zip(drafting, chains):
            r = rows[i]
            r.lookup.extend(r.prompt, r.output)
            spliced = splice(drafts, r.lookup.continuation(len(drafts)))
            if spliced is not None:
                block[i, 1:] = torch.tensor(spliced, dtype=block.dtype)
                r.stats.lookup_splices += 1
                continued.add(i)
        return continued

    def _proposal_input(self, batch: Batch, drafting: list[int], noise: list[torch.Tensor] | None,
                        draft_width: int) -> ProposalInput:
        """What the drafting method receives for the rows `drafting` (and every row's new features), for a block of
        `draft_width` positions."""
        rows, dev = batch.rows, self.target.device
        idx = None if len(drafting) == len(rows) else torch.tensor(drafting, device=dev)
        drafters = [rows[i] for i in drafting]
        new_features = None  # the drafting rows' pending context: the proposer writes it now
        if self.proposer.needs_features:
            new_features = take_pending([r.pending for r in drafters], *self._feature_spec)
        histories = self.proposer.needs_histories
        k = draft_width - 1
        draft_noise = temperatures = None
        if any(not r.params.greedy for r in drafters):  # else every drafting row drafts its argmax, noise or not
            temperatures = torch.tensor([r.params.temperature for r in drafters], dtype=torch.float32, device=dev)
            if noise is not None:
                draft_noise = torch.stack([noise[i][:k] for i in drafting])
        bonus = torch.tensor([r.bonus for r in drafters], dtype=torch.long, device=dev)
        n_cached = torch.tensor([r.n_cached for r in drafters], dtype=torch.long, device=dev)
        block_positions = n_cached[:, None] + torch.arange(draft_width, device=dev)[None]
        return ProposalInput(bonus, block_positions, max(r.n_cached for r in drafters),
                             new_features, [r.history for r in drafters] if histories else None,
                             [r.index for r in drafters] if histories else None,
                             draft_noise, temperatures, draft_rows=idx)

    def _tree_step(self, batch: Batch, drafting: list[int], noise: list[torch.Tensor] | None):
        """Propose, target forward and verify with token trees for the rows `drafting` (the others: one-token
        steps, as trees of their root alone). Returns what `_commit_block` takes, each row's tree linearised into
        its accepted path: (block, features, nodes verified, accepted, next tokens) and the time the
        draft was done."""
        rows, dev, prof = batch.rows, self.target.device, self.profiler
        inp = self._proposal_input(batch, drafting, noise, self.block_size)
        ids, logp = self.proposer.propose_candidates(batch.proposer_state, inp, self.block_size, TREE_CANDIDATES)
        most = self.tree_sizes[-1] - 1 if self.tree_budget == "auto" else self.tree_budget
        grown = [best_first(rows[i].bonus, ids[j], logp[j], most) for j, i in enumerate(drafting)]
        nodes = self._tree_nodes(batch, grown)
        trees = [RowTree([r.bonus], [-1], [0], [0.0]) for r in rows]
        lookup = self.config.lookup_ngram
        for j, i in enumerate(drafting):
            trees[i] = grown[j].prefix(nodes)
            if lookup:
                trees[i] = add_branch(trees[i], lookup_continuation(rows[i].history, lookup, self.block_size - 1))
        drafted_at = self._clock()
        prof.mark("draft")
        # 2. one forward over every row's tree: node j at position n + depth, K/V in scratch slot n + j
        n_cached = torch.tensor([r.n_cached for r in rows], dtype=torch.long, device=dev)
        sizes = [len(t.tokens) for t in trees]
        groups, stacked, inputs = width_groups(sizes, dev), [], []
        for w, idx in groups:
            tree = stack([trees[i] for i in idx.tolist()], dev)
            context = n_cached.index_select(0, idx)
            group = (idx, tree.tokens, context[:, None] + tree.depths)
            if w > 1:
                slots = context[:, None] + torch.arange(w, device=dev)[None]
                group += (slots, tree_attention_mask(tree.ancestors(), context, int(context.max()) + w))
            inputs.append(group)
            stacked.append(tree)
        capture = self.proposer.needs_features
        outputs = batch.kv.forward_ragged(inputs, capture, max(r.n_cached for r in rows) + max(sizes))
        prof.mark("target")
        # 3. walk each tree; its accepted path becomes a chain: tokens, features, K/V moved to consecutive slots
        depth = max(t.path_depth() for t in stacked) + 1
        block = torch.zeros(len(rows), depth, dtype=torch.long, device=dev)
        features = None
        accepted, next_tokens = [0] * len(rows), [0] * len(rows)
        for (w, idx), tree, (logits, group_features) in zip(groups, stacked, outputs):
            members = idx.tolist()
            group_noise = torch.stack([noise[i] for i in members]) if noise is not None else None
            verdict = verify_tree(logits, tree, [rows[i].params for i in members],
                                  [rows[i].generator for i in members], group_noise)
            path = torch.tensor([p + [p[-1]] * (depth - len(p)) for p in verdict.paths], device=dev)
            block[idx] = tree.tokens.gather(1, path)
            if group_features is not None:
                if features is None:
                    features = group_features.new_zeros(len(rows), depth, group_features.shape[-1])
                features[idx] = group_features.gather(1, path[..., None].expand(-1, -1, group_features.shape[-1]))
            if w > 1:
                context = n_cached.index_select(0, idx)[:, None]
                batch.kv.move_slots(idx, context + path, context + torch.arange(depth, device=dev)[None])
                for i, row_path in zip(members, verdict.paths):
                    self.tree_calibration.observe(trees[i], row_path)
            for i, a, t in zip(members, verdict.num_accepted.tolist(), verdict.next_tokens.tolist()):
                accepted[i], next_tokens[i] = a, t
        prof.mark("verify")
        return block, features, sizes, accepted, next_tokens, drafted_at

    def _tree_nodes(self, batch: Batch, trees: list[RowTree]) -> int:
        """Nodes per drafting row's tree this cycle (root included): the budget's, or with "auto" the size of
        `tree_sizes` that maximises expected committed tokens per second: the trees' expected accepted
        lengths (scaled by how trees of that size have done, `TreeCalibration`) against what tree cycles that
        verified that many tokens have cost (`tree_costs`)."""
        if self.tree_budget != "auto":
            return self.tree_budget + 1
        plain = len(batch.rows) - len(trees)
        best, best_rate = self.block_size, 0.0
        for size in self.tree_sizes:
            nodes = [min(size, len(t.tokens)) for t in trees]  # a small block's trees may hold fewer
            seconds = self.tree_costs.cycle(plain + sum(nodes), len(trees) * self.block_size)
            if seconds is None:
                break
            scale = self.tree_calibration.scale(size)
            gain = plain + sum(1.0 + scale * t.expected_accepted()[n - 1] for t, n in zip(trees, nodes))
            if gain / seconds > best_rate:
                best, best_rate = size, gain / seconds
        return best

    def _target_forward(self, batch: Batch, block, positions, groups, prompts=(), noise=None):
        """The target over each row's block: logits [g, w, V] per width group (where the target screens its
        read-out and every row takes its argmax, `_chooses`: the chosen token ids [g, w]), features [b, W, F] (or
        None), and (last logits [1, 1, V], features [1, n, F] or None) per prompt of `prompts` (`_seat`) prefilled
        beside. `noise`: the rows' noise windows (`_noise`), or their Future (`_noise_soon`): the race offsets are
        then made on the noise thread too and passed as a callable, which the target calls after its layers."""
        capture = self.proposer.needs_features
        end = max(r.n_cached for r in batch.rows) + block.shape[1]  # 1 + the largest position in the blocks
        choose = self._chooses(batch.rows, noise)
        offsets = None
        if choose and isinstance(noise, Future):  # made on the noise thread after the noise, read after the layers
            rows = list(batch.rows)
            offsets = self._noise_worker.submit(
                lambda: [self._race_offsets(rows, noise.result(), w, idx) for w, idx in groups]).result
        elif choose:
            offsets = [self._race_offsets(batch.rows, noise, w, idx) for w, idx in groups]
        if len(groups) == 1 and not prompts:
            logits, features = batch.kv.forward_block(block, positions, capture, end, choose,
                                                      (lambda: offsets()[0]) if callable(offsets)
                                                      else offsets[0] if offsets else None)
            return [logits], features, []
        if self.ragged:
            outputs = batch.kv.forward_ragged([(idx, block[idx, :w], positions[idx, :w]) for w, idx in groups],
                                              capture, end, prompts, greedy=choose, offsets=offsets)
            outputs, prompt_outputs = outputs[:len(groups)], outputs[len(groups):]
            features = None
            if capture:
                width_features = outputs[0][1].shape[-1]
                features = outputs[0][1].new_zeros(block.shape[0], block.shape[1], width_features)
                for (w, idx), (_, f) in zip(groups, outputs):
                    features[idx, :w] = f
            return [lg for lg, _ in outputs], features, prompt_outputs
        logits, features = batch.kv.forward_block(block, positions, capture, end)  # padded to the widest
        return [logits.index_select(0, idx)[:, :w] for w, idx in groups], features, []

    def _chooses(self, rows: list[_Row], noise) -> bool:
        """Whether the target's screened read-out picks every row's tokens this cycle: each row greedy, or sampled
        by the race under counter-based noise at plain temperature (top-k, top-p and min-p need the distribution)."""
        return self.screens_readout and not _reads_logits(rows) and all(
            r.params.greedy or (noise is not None and not r.params.restricted) for r in rows)

    @staticmethod
    def _race_offsets(rows: list[_Row], noise, width: int, idx: torch.Tensor) -> torch.Tensor | None:
        """The width group's offsets to its logits that make their argmax each sampled row's race winner [g, w, V]
        (`noise.race_offsets`); None when every row is greedy."""
        members = idx.tolist()
        if noise is None or all(rows[i].params.greedy for i in members):
            return None
        temperatures = torch.tensor([max(rows[i].params.temperature, 1e-6) for i in members])
        return race_offsets(_group_noise(noise, members, width), temperatures)

    def _seat(self, batch: Batch, rows: Sequence[_Row]):
        """Target cache rows, after the live ones, for rows whose prompts this cycle's forward prefills (pages for
        the prompt and a block, as `_prefill` gives), and their drafter state; returns (that state, one prompt
        group per row for `forward_ragged`)."""
        dev = self.target.device
        lengths = [len(r.prompt) + self.scratch_slots for r in rows]
        first = batch.kv.num_rows
        batch.kv.add_rows(lengths)
        hits = self._prefix_hits(rows, [r.prompt for r in rows]) or [NO_HIT] * len(rows)
        if self.prefix_cache is not None:
            self.prefix_cache.load(batch.kv.kv, range(first, first + len(rows)), hits)
        state = self._new_proposer_state()
        state.grow(lengths)
        prompts = [(torch.tensor([first + j], device=dev), torch.tensor([r.prompt[hit.tokens:]], device=dev),
                    torch.arange(hit.tokens, len(r.prompt), device=dev)[None])
                   for j, (r, hit) in enumerate(zip(rows, hits))]
        return Seating(state, prompts, hits if self.prefix_cache is not None else None, first)

    def _join(self, batch: Batch, rows: Sequence[_Row], seating: "Seating", outputs) -> None:
        """Rows whose prompts rode this cycle's forward join the batch below the others, as `_prefill` leaves
        new rows: first token sampled, the prompt's features pending for the drafter (long ones written now), its
        pages in the prefix cache."""
        self._first_tokens(rows, torch.cat([logits[:, -1] for logits, _ in outputs]))
        features = None
        if outputs[0][1] is not None:  # copies: a view would hold the whole cycle's features
            features = [f[0].clone() for _, f in outputs]
        if seating.hits is not None:
            features = self._cache_prompts(batch.kv.kv, range(seating.first, seating.first + len(rows)), rows,
                                           [r.prompt for r in rows], seating.hits, features)
        batch.proposer_state.merge(seating.state, len(batch.rows), len(rows))
        batch.rows = batch.rows + list(rows)
        if features is not None:
            self._pend_prompts(batch, rows, features)

    def _verify(self, rows, groups, logits, block, drafting, draft_probs, noise) -> tuple[list[int], list[int]]:
        """The shared verifier over each width group: per row the accepted drafts and the next token. `logits`:
        per group the target's logits, or (a screened read-out, `_chooses`) its chosen token ids [g, w]."""
        accepted, next_tokens = [0] * len(rows), [0] * len(rows)
        draft_row = {r: j for j, r in enumerate(drafting)}  # row -> its row in draft_probs
        for (w, idx), group_logits in zip(groups, logits):
            members = idx.tolist()
            drafts = block[:, 1:w] if len(members) == len(rows) else block.index_select(0, idx)[:, 1:w]
            if group_logits.dim() == 2:  # the target's chosen token ids
                verdict = accept_chosen(group_logits, drafts)
            else:
                probs = None
                if draft_probs is not None and w > 1:
                    if all(i in draft_row for i in members):
                        probs = draft_probs[[draft_row[i] for i in members], :w - 1]
                    else:  # lookup continuations beside drafts with a q: one-hot, as the verifier reads argmax drafts
                        probs = torch.stack([draft_probs[draft_row[i], :w - 1] if i in draft_row else
                                             torch.nn.functional.one_hot(block[i, 1:w], draft_probs.shape[-1])
                                             .to(draft_probs.dtype) for i in members])
                verdict = verify(group_logits, drafts, [rows[i].params for i in members],
                                 [rows[i].generator for i in members], probs, _group_noise(noise, members, w))
            for i, a, t in zip(members, verdict.num_accepted.tolist(), verdict.next_tokens.tolist()):
                accepted[i], next_tokens[i] = a, t
        return accepted, next_tokens

    def _commit_block(self, batch: Batch, block, features, widths, accepted, next_tokens, draft_width: int,
                      copies: dict[int, list[int]], drafting: Sequence[int] = (),
                      logprobs: dict[int, list[TokenLogprob]] | None = None) -> None:
        """Each row keeps its accepted drafts plus the target's own token; the kept slots' target features go to
        the drafter. `copies`: rows whose one-token step verified a lookup continuation (`_lookup_copies`);
        `drafting`: rows that drafted (a confidence trim may have left one verifying its bonus alone); `logprobs`:
        the committed tokens' log-probabilities of the rows that ask (`_committed_logprobs`)."""
        rows, width = batch.rows, block.shape[1]
        kept = torch.tensor(accepted, device=block.device)
        kept_valid = torch.arange(width, device=block.device)[None] < kept[:, None] + 1
        batch.kv.keep(kept_valid)
        if features is not None:  # each row's kept slots wait for its next draft (a copy of the kept columns, if
            # some were not kept: a view would hold the whole block's features)
            longest = max(accepted) + 1
            kept_features = features if longest == features.shape[1] else features[:, :longest].clone()
            kept = [values if a + 1 == longest else values[:a + 1]
                    for values, a in zip(kept_features.unbind(0), accepted)]
            for r, values in zip(rows, kept):
                r.pending.add(values, r.n_cached)
            self._write_long_pending(batch)
        for i, (r, w, a, nxt, blk) in enumerate(zip(rows, widths, accepted, next_tokens, block.tolist())):
            if i in copies:
                r.stats.lookup_steps += 1
                r.stats.lookup_drafts += w - 1
                r.stats.lookup_accepted += a
            elif w > 1 or i in drafting:
                r.stats.acceptance_lengths.append(a + 1)
                r.stats.verify_widths.append(w)
                r.stats.draft_lengths.append(draft_width)
            else:
                r.stats.plain_steps += 1
            r.n_cached += a + 1
            r.bonus = nxt
            self._append(r, blk[1:1 + a] + [nxt], logprobs.get(i) if logprobs else None)
        if self.prefix_cache is not None:
            self._cache_output_pages(batch, kept if features is not None else None)

    def _append(self, r: _Row, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Append tokens (with their log-probabilities, if the row asks) to a row's output, applying max_new_tokens,
        stop ids and stop strings."""
        p = r.params
        for t in tokens:
            if len(r.output) >= p.max_new_tokens:
                break
            r.output.append(t)
            if r.grammar is not None:
                r.grammar.consume(t)
            if t in p.stop_token_ids or (r.grammar is not None and r.grammar.ended):
                r.finish_reason, r.stop_token = "stop", True
                break
        if r.finish_reason is None and len(r.output) >= p.max_new_tokens:
            r.finish_reason = "length"
        if self.tokenizer is not None:
            self._update_text(r)
        if r.logprobs is not None:  # as many as the output kept of these tokens (a stop may have ended it inside them)
            r.logprobs.extend(logprobs[:len(r.output) - len(r.logprobs)] if logprobs else ())
        if r.finish_reason is not None:
            r.stats.output_tokens = len(r.output)
            r.stats.decode_time = time.perf_counter() - r.started - r.stats.time_to_first_token

    def _update_text(self, r: _Row) -> None:
        """Decode the new tokens (`detokenize.py`: bounded work per cycle) and apply stop strings: the text is cut
        at the first one and the output keeps the fewest tokens whose text holds all of it. As in vLLM, a stop id
        that ended the row stays in its tokens but not in its text (unless `include_stop_str_in_output`), and stop
        strings ending in the text of the first `min_tokens` tokens do not count."""
        p = r.params
        if r.detok is None:
            r.detok = IncrementalText(self.tokenizer, p.stop_strings, p.include_stop_str_in_output,
                                      hold_stops=p.min_tokens > 0, skip_special_tokens=p.skip_special_tokens)
        if r.detok.holding_stops and len(r.output) > p.min_tokens:
            r.detok.search_from(len(r.detok.decode(r.output[:p.min_tokens])))
        shown = r.output[:-1] if r.stop_token and not p.include_stop_str_in_output else r.output
        keep = r.detok.update(shown, final=r.finish_reason is not None)
        if keep is not None:
            del r.output[keep:]
            r.finish_reason = "stop"

    def _drop_finished(self, batch: Batch) -> None:
        keep = [i for i, r in enumerate(batch.rows) if r.finish_reason is None]
        if len(keep) < len(batch.rows):
            self._keep_rows(batch, keep)

    def _keep_rows(self, batch: Batch, keep: list[int]) -> None:
        """Rows `keep` stay, in that order; an emptied batch lets its caches go (the next merge adopts the
        incoming rows' caches wholesale)."""
        if keep:
            batch.select_rows(torch.tensor(keep, dtype=torch.long, device=self.target.device))
            return
        batch.rows, batch.kv = [], None
        batch.proposer_state = self._new_proposer_state()

    def _events(self, rows: list[_Row]) -> Iterator[StreamEvent]:
        for r in rows:
            finished = r.finish_reason is not None
            if r.reported or (r.emitted_tokens == len(r.output) and not finished):
                continue
            new_tokens = r.output[r.emitted_tokens:]
            new_logprobs = None if r.logprobs is None else r.logprobs[r.emitted_tokens:]
            first_event = r.emitted_tokens == 0
            r.emitted_tokens = len(r.output)
            text_delta = None
            if r.detok is not None:  # held back: an incomplete character, a possible stop-string prefix
                text_delta = r.detok.delta(finished)
            result = None
            if finished:
                r.reported = True
                result = GenerationResult(list(r.output), r.detok.text if r.detok is not None else None,
                                          r.finish_reason, r.stats, None if r.logprobs is None else list(r.logprobs),
                                          r.prompt_logprobs)
            yield StreamEvent(r.index, new_tokens, text_delta, finished, result, new_logprobs,
                              r.prompt_logprobs if first_event else None)
