"""Drafting methods. Each one proposes the k = block_size - 1 tokens that follow each row's bonus token; the
shared verifier (`verify.py`) decides what is kept.

A method is stateless; what it remembers per row lives in a state object it creates for each live batch
(`new_batch_state(buckets, page_size, max_pages)`), which follows the batch's live rows through
`select_rows(idx)` (rows left), `merge(other, keep, add)` (rows [0, keep) stay, the `add` rows of `other`, a state
of the same method, join below them) and `grow(lengths)` (live row r may reach positions < lengths[r]); a state
with a paged cache pads it to `buckets.rows(live)` rows itself (padding rows own no pages).
A method with `needs_features` receives the drafting rows' context pending since each last drafted, and also takes
`reserve(state, live)` (a new batch) and `absorb(state, features, block_size, rows)`: context to remember without
drafting (rows whose pending context grew long).
A method receives exactly what it declares: target features with `needs_features`, the committed tokens and
request ids of each row with `needs_histories`.

- `DFlashProposer`: the target features of the newly committed positions are written into the drafter's static
  context cache (the batch state, slot = position), then one drafter forward over `[bonus, MASK x k]` per row.
  Greedy rows draft the argmax; sampled rows under counter-based noise run the target's exponential race on the
  drafter's own distribution (argmax q / E with the same noise), so a draft is the target's sample whenever the
  two distributions agree there. With `confidence` set (eager drafts; the engine sets it where its policy trims
  verify widths), each propose also leaves in `last_confidence` [rows, k] the drafter's confidence in each token it
  drafted: greedy rows its probability against the runner-up's, p1 / (p1 + p2) (the logits' top-two gap: a full
  softmax cost ~6x the argmax, and predicted acceptance no better on the shipped pair), sampled rows its
  probability at the row's temperature (the race computes that distribution anyway). With `keep_scores` set (the
  engine sets it for cycles where a row's text follows a grammar), an eager propose also leaves the drafter's
  logits over the draft positions, for `drafted_scores`: the engine moves refused drafts to allowed tokens with them.
  With `compile=True` (`compiled.py`) features arrive in chunks of one block and the write of the last chunk
  and the draft run as ONE compiled graph (one call, one guard check per cycle).
- `NoProposer`: plain autoregressive decoding (block size 1) through the same engine, the baseline.

What this module does not know about: the target's KV cache and sampling of committed tokens.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flashdraft.engine.argmax import argmax, argmax_and_gap
from flashdraft.engine.batch import Features, RowBuckets
from flashdraft.engine.compiled import compile_step
from flashdraft.engine.noise import race
from flashdraft.engine.tree import candidate_lists
from flashdraft.model.cpu_linear import pack_by_default, packed_linear
from flashdraft.model.draft_vocab import draft_targets
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.slots import DEFAULT_PAGE_SIZE
from flashdraft.model.target import TargetModel


@dataclass
class ProposalInput:
    bonus: torch.Tensor  # [b] the last committed token of each row, not yet in the target's cache
    positions: torch.Tensor  # [b, block_size] absolute positions of the block
    context_len: int  # the longest committed context of a row (= max position of a bonus token)
    new_features: Features | None = None  # with `needs_features`: target features committed since the last call
    histories: list[list[int]] | None = None  # with `needs_histories`: committed tokens per row, bonus included
    request_ids: list | None = None  # with `needs_histories`: the request id of each row
    # sampled rows under counter-based noise (`noise.py`): the noise of the k draft positions [b, k, V] (ones for
    # greedy rows; None when every row is greedy or the sampler is rejection sampling); each row's temperature [b]
    # (0 = greedy; None when every row is greedy)
    noise: torch.Tensor | None = None
    temperatures: torch.Tensor | None = None
    # the rows that draft this cycle (indices into the batch's live rows; None: every row). bonus, positions,
    # histories, request ids, noise, temperatures and new_features are the drafting rows' (the other rows keep
    # their context pending until they draft)
    draft_rows: torch.Tensor | None = None


class NoRowState:
    """Batch state of a method that remembers nothing per row."""

    def select_rows(self, rows: torch.Tensor) -> None:
        pass

    def merge(self, other: "NoRowState", keep: int, add: int) -> None:
        pass

    def grow(self, lengths: list[int], keep_from: list[int] | None = None) -> None:
        pass


class NoProposer:
    needs_features = needs_histories = False

    def new_batch_state(self, buckets: RowBuckets = RowBuckets(), page_size: int = DEFAULT_PAGE_SIZE,
                        max_pages: int | None = None) -> NoRowState:
        return NoRowState()

    def propose(self, state, inp: ProposalInput, block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return inp.bonus.new_zeros(inp.bonus.shape[0], 0), None


class DraftRows:
    """Batch state of `DFlashProposer`: the drafter's paged context cache, with `buckets.rows(live)` rows: the live
    ones, then padding (no pages). Allocated at the first write, not at prefill: newcomers that never draft (a
    loaded server's one-token steps) cost no cache, and merging them costs no copy (allocating one per prefill
    and merging it added ~1 ms to the ~9 ms prefill of a ~100-token prompt on CPU)."""

    def __init__(self, buckets: RowBuckets, new_cache):
        self.kv = None
        self.buckets = buckets
        self.new_cache = new_cache  # (rows, lengths) -> the drafter's context cache, pages for those lengths
        self.lengths: list[int] = []  # positions each live row may reach (`grow`)
        self.keep_from: list[int] | None = None  # per live row, the first position its drafts query (`grow`)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.lengths, self.keep_from = [self.lengths[i] for i in rows.tolist()], None
        if self.kv is not None:
            self.kv.select_rows(self.buckets.padded_index(rows))

    def merge(self, other: "DraftRows", keep: int, add: int) -> None:
        """Our rows [0, keep), then other's `add` live rows with the context already written for them."""
        pad = self.buckets.rows(keep + add) - keep - add
        self.lengths, self.keep_from = self.lengths[:keep] + other.lengths[:add], None
        if other.kv is None:  # nothing written for the newcomers yet: fresh rows
            if self.kv is not None:
                self.kv.join_rows(keep, add + pad)
            return
        if other.kv.batch > add:
            other.kv.select_rows(torch.arange(add, device=other.kv.keys[0].device))
        if self.kv is None:  # nothing written for our rows yet: fresh rows above the newcomers'
            self.kv = self.new_cache(keep, self.lengths[:keep])
        self.kv.merge(other.kv, keep=keep, pad=pad)

    def grow(self, lengths: list[int], keep_from: list[int] | None = None) -> None:
        """Live row r may reach positions < lengths[r] (the target's cache grew), and its drafts query no position
        before keep_from[r] (its committed length: a sliding drafter's pages before it less the window go back).
        Its pages here are taken when context is next written (`reserved`): a row at one-token steps writes
        nothing, and taking its pages every cycle cost ~1 % of a 64-row one-token step."""
        self.lengths, self.keep_from = lengths, keep_from

    def cache(self):
        """The cache, allocated for the live rows if it was not yet (padding rows own no pages: what they write
        goes to the trash page); rows are written when they draft or when their pending context grows long."""
        if self.kv is None:
            self.kv = self.new_cache(self.buckets.rows(len(self.lengths)), self.lengths)
        return self.kv

    def reserved(self):
        """The cache, with pages for every live row's positions < lengths[r] (before writing into it)."""
        self.cache().reserve(self.lengths, self.keep_from)
        return self.kv


class DFlashProposer:
    """Drafts a block with a DFlash drafter; drafts are the drafter's argmax (one-hot draft distribution).

    Built for a DFlash2 drafter (one with a candidate selector), it is a `DFlash2Proposer` (`dflash2_proposer.py`),
    which reuses everything here but the choice of tokens (`_draft_tokens`, `_proposal`)."""

    needs_features = True
    needs_histories = False
    confidence = False  # eager drafts leave the drafter's confidence in each draft in `last_confidence`
    last_confidence: torch.Tensor | None = None
    keep_scores = False  # eager drafts leave the drafter's logits [rows, k, V] in `last_scores`
    last_scores: torch.Tensor | None = None

    def __new__(cls, drafter=None, *args, **kwargs):  # (drafter=None: copy and pickle call it bare)
        if cls is DFlashProposer and getattr(drafter, "candidate_selector", None) is not None:
            from flashdraft.engine.dflash2_proposer import DFlash2Proposer

            cls = DFlash2Proposer
        return super().__new__(cls)

    def __init__(self, drafter: DFlashDraftModel, target: TargetModel, compile: bool = False,
                 pack_weights: bool | None = False):
        self.drafter = drafter
        self.target = target
        # the drafter may run in another dtype than the target (e.g. bf16 drafts for an fp32 target on CPU):
        # drafts only steer acceptance, the verifier alone decides the output
        self.embedding_weight = target.embedding_weight.to(drafter.dtype)
        lm_head = drafter.readout(target.lm_head)
        if lm_head.weight.dtype != drafter.dtype:
            lm_head = copy.deepcopy(lm_head).to(drafter.dtype)
        # CPU: the vocabulary projection through oneDNN on a packed copy (`cpu_linear.py`; the drafter's own
        # projections gained nothing measurable end to end, so they stay as they are). None: where packing is
        # faster for this read-out itself, a block's rows at a time; it may run in another dtype than the target,
        # whose measurement can go the other way (an AMX Xeon: MKL for the fp32 target, oneDNN for the bf16
        # read-out, 5 % of the draft)
        if pack_weights is None:
            pack_weights = isinstance(lm_head, nn.Linear) and pack_by_default([lm_head.weight],
                                                                              rows=(drafter.block_size,))
        self.lm_head = packed_linear(lm_head) if pack_weights else lm_head
        # a reduced draft vocabulary: the target id of each draft id (`draft_vocab.py`); None: the target's own ids
        self.draft_targets = draft_targets(drafter.d2t) if getattr(drafter, "d2t", None) is not None else None
        self.compiled = compile
        self._write_step = compile_step(drafter.write_context, drafter.device) if compile else None
        self._draft_step = compile_step(self._draft_tokens, drafter.device) if compile else None

    def new_batch_state(self, buckets: RowBuckets = RowBuckets(), page_size: int = DEFAULT_PAGE_SIZE,
                        max_pages: int | None = None) -> DraftRows:
        return DraftRows(buckets, functools.partial(self.drafter.new_cache, page_size=page_size, max_pages=max_pages))

    def _context(self, state: DraftRows, new_features: Features):
        """Every live row's new features, padded to the cache's rows: (cache rows, features, positions, valid)."""
        live = new_features.values.shape[0]
        b = state.reserved().batch
        context = new_features if b == live else new_features.pad_rows(b)
        return (b, *(t.to(self.drafter.device) for t in context.astuple()))

    def _write_rows(self, state: DraftRows, new_features: Features, rows: torch.Tensor) -> None:
        """Eager: the features of live rows `rows` into those rows of the drafter's cache."""
        if not new_features.values.shape[1]:
            return
        dev = self.drafter.device
        self.drafter.write_context(state.reserved(), *(t.to(dev) for t in new_features.astuple()), rows=rows.to(dev))

    def absorb(self, state: DraftRows, new_features: Features, block_size: int,
               rows: torch.Tensor | None = None) -> None:
        """Write pending context into the drafter's cache without drafting: the features of live rows `rows`
        (eager; None: every live row's, as compiled steps need), so no row's pending context grows without bound."""
        if rows is not None:
            self._write_rows(state, new_features, rows)
            return
        _, features, positions, valid = self._context(state, new_features)
        if not self.compiled:
            self.drafter.write_context(state.kv, features, positions, valid)
            return
        for chunk in _chunks(features, positions, valid, block_size):
            self._write_step(state.kv, *chunk)

    def propose(self, state: DraftRows, inp: ProposalInput,
                block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        dev = self.drafter.device
        self.last_confidence = self.last_scores = None
        if inp.draft_rows is not None:  # some rows draft (eager: compiled steps draft every row)
            if self.compiled:
                raise RuntimeError("compiled drafting steps draft every row; draft_rows must be None")
            rows = inp.draft_rows.to(dev)
            self._write_rows(state, inp.new_features, rows)
            drafting = len(rows)
            block = torch.full((drafting, block_size), self.drafter.mask_token_id, dtype=torch.long, device=dev)
            block[:, 0] = inp.bonus.to(dev)
            noise, scale, greedy = _race_inputs(inp, 0, dev)
            written = (t[:, :0].to(dev) for t in inp.new_features.astuple())  # nothing more to write
            drafts = self._draft_tokens(state.cache().gather_rows(rows, inp.context_len), *written, block,
                                        inp.positions.to(dev), inp.context_len, noise, scale, greedy)
            return self._proposal(drafts, drafting, inp.bonus.device)
        live = inp.new_features.values.shape[0]
        b, features, positions, valid = self._context(state, inp.new_features)
        block = torch.full((b, block_size), self.drafter.mask_token_id, dtype=torch.long, device=dev)
        block[:live, 0] = inp.bonus.to(dev)
        block_positions = state.buckets.pad(inp.positions, b).to(dev)
        noise, scale, greedy = _race_inputs(inp, b - live, dev)
        if not self.compiled:
            return self._proposal(self._draft_tokens(state.kv, features, positions, valid, block, block_positions,
                                                     inp.context_len, noise, scale, greedy), live, inp.bonus.device)
        # compiled: context arrives in chunks of one block (one static shape, whatever arrived); all but the last
        # chunk (only after a prefill) are written on their own, the last one in the same graph as the draft
        chunks = _chunks(features, positions, valid, block_size)
        for chunk in chunks[:-1]:
            self._write_step(state.kv, *chunk)
        drafts = self._draft_step(state.kv, *chunks[-1], block, block_positions, None, noise, scale, greedy)
        return self._proposal(drafts, live, inp.bonus.device)

    def propose_candidates(self, state: DraftRows, inp: ProposalInput, block_size: int,
                           top: int) -> tuple[list, list]:
        """For token trees (eager only): the drafting rows' top `top` candidates at every draft position and their
        log-probabilities, most likely first, as lists [rows][k][top] (`tree.candidate_lists`). The scores are the
        marginals' (DFlash2 drafters too: a tree branches where the selector would pick one); sampled rows rank
        by softmax(logits / T), under counter-based noise perturbed by it (log q - log E: the first candidate is
        the draft `propose` makes)."""
        dev = self.drafter.device
        if inp.draft_rows is None:
            self.absorb(state, inp.new_features, block_size)
            kv = state.kv
        else:
            self._write_rows(state, inp.new_features, inp.draft_rows)
            kv = state.cache().gather_rows(inp.draft_rows.to(dev), inp.context_len)
        block = torch.full((inp.bonus.shape[0], block_size), self.drafter.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = inp.bonus.to(dev)
        hidden = self.drafter.draft(kv, self.drafter.embed(block, self.embedding_weight), inp.positions.to(dev),
                                    inp.context_len)[:, 1:]
        scores = self.drafter.draft_logits(hidden, self.lm_head).float()
        if inp.temperatures is not None:
            temps = inp.temperatures.to(dev, torch.float32)
            scores = scores * torch.where(temps > 0, 1.0 / temps.clamp_min(1e-6), 1.0)[:, None, None]
        if inp.noise is not None:
            noise = inp.noise.to(dev)
            if self.draft_targets is not None:
                noise = noise.index_select(-1, self.draft_targets)
            scores = torch.log_softmax(scores, dim=-1) - noise.log()
        ids, logp = candidate_lists(scores, top)
        if self.draft_targets is not None:
            to_target = self.draft_targets.tolist()
            ids = [[[to_target[i] for i in position] for position in row] for row in ids]
        return ids, logp

    def drafted_confidence(self) -> torch.Tensor | None:
        """The drafter's confidence in each token the last `propose` drafted [rows, k] (None without `confidence`,
        and after compiled drafts)."""
        return self.last_confidence

    def drafted_scores(self) -> torch.Tensor | None:
        """The drafter's logits over the target's vocabulary at the last `propose`'s draft positions [rows, k, V]
        (-inf outside a reduced draft vocabulary; None without `keep_scores`, and after compiled drafts)."""
        scores = self.last_scores
        if scores is None or self.draft_targets is None:
            return scores
        full = scores.new_full((*scores.shape[:-1], self.target.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_targets, scores)

    def _proposal(self, drafts: torch.Tensor, live: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(drafts [live, k], draft distributions or None for one-hot drafts) from what `_draft_tokens` returned."""
        if self.last_confidence is not None:
            self.last_confidence = self.last_confidence[:live].to(device)
        if self.last_scores is not None:
            self.last_scores = self.last_scores[:live].to(device)
        return drafts[:live].to(device), None

    def _draft_tokens(self, kv, features, feature_positions, feature_valid, block: torch.Tensor,
                      positions: torch.Tensor, context_len: int | None, noise: torch.Tensor | None = None,
                      inverse_temperature: torch.Tensor | None = None,
                      greedy_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Write the newly committed context into the drafter's cache, then draft one block per row: the argmax,
        or with `noise` the winner of the exponential race on softmax(logits / T) (greedy rows: noise 1, 1/T 1, so
        `greedy_rows` is not needed here)."""
        hidden = self._draft_hidden(kv, features, feature_positions, feature_valid, block, positions, context_len)
        logits = self.drafter.draft_logits(hidden, self.lm_head)  # over the draft vocabulary
        if self.keep_scores and not torch.compiler.is_compiling():
            self.last_scores = logits
        confident = self.confidence and not torch.compiler.is_compiling()
        if noise is None:
            if not confident:
                return self._target_ids(argmax(logits))
            ids, gap = argmax_and_gap(logits)
            self.last_confidence = torch.sigmoid(gap)  # p1 / (p1 + p2): the draft's probability against its runner-up
            return self._target_ids(ids)
        if self.draft_targets is not None:  # the race over the draft vocabulary: its ids' noise columns only
            noise = noise.index_select(-1, self.draft_targets)
        q = marginal(logits, inverse_temperature)
        ids = race(q, noise)
        if confident:  # sampled rows: q of the draft; greedy rows (their argmax): as without noise
            self.last_confidence = q.gather(-1, ids[..., None])[..., 0]
            if greedy_rows is not None and bool(greedy_rows.any()):
                self.last_confidence[greedy_rows] = torch.sigmoid(argmax_and_gap(logits[greedy_rows])[1])
        return self._target_ids(ids)

    def _target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids as target ids (identity unless the drafter has a reduced vocabulary)."""
        return draft_ids if self.draft_targets is None else self.draft_targets[draft_ids]

    def _draft_hidden(self, kv, features, feature_positions, feature_valid, block, positions, context_len):
        """The drafter's hidden states [b, k, H] at the k draft positions, after writing the new context (none:
        the context was written already and `kv` may be a read-only gather)."""
        if features.shape[1]:
            self.drafter.write_context(kv, features, feature_positions, feature_valid)
        embeds = self.drafter.embed(block, self.embedding_weight)
        return self.drafter.draft(kv, embeds, positions, context_len)[:, 1:]


def marginal(logits: torch.Tensor, inverse_temperature: torch.Tensor) -> torch.Tensor:
    """softmax(logits / T) in float32 of logits [b, k, V], one 1 / T per row [b]."""
    return torch.softmax(logits.float() * inverse_temperature[:, None, None], dim=-1)


def marginal_race(logits: torch.Tensor, noise: torch.Tensor, inverse_temperature: torch.Tensor) -> torch.Tensor:
    """Each draft position's winner of the exponential race on softmax(logits / T) under its noise [b, k, V]
    (greedy rows carry noise 1 and 1/T = 1: their argmax)."""
    return race(marginal(logits, inverse_temperature), noise)


def _race_inputs(inp: ProposalInput, padding_rows: int, dev):
    """The drafting rows' noise [b, k, V] (padding rows: 1; None without noise), 1 / T per row [b] (1 for greedy
    and padding rows; with temperatures but no noise, rejection sampling, 0 marks the greedy rows; None when every
    row is greedy) and, with noise, the greedy rows [b] (bool; None when no row is greedy)."""
    noise = scale = greedy = None
    if inp.noise is not None:
        noise = torch.cat([inp.noise, inp.noise.new_ones((padding_rows, *inp.noise.shape[1:]))]).to(dev)
    if inp.temperatures is not None:
        temps = inp.temperatures.to(dev, torch.float32)
        scale = torch.where(temps > 0, 1.0 / temps.clamp_min(1e-6), 1.0 if noise is not None else 0.0)
        scale = torch.cat([scale, temps.new_ones(padding_rows)])
        if noise is not None and bool((inp.temperatures <= 0).any()):
            greedy = torch.cat([temps <= 0, temps.new_zeros(padding_rows, dtype=torch.bool)])
    return noise, scale, greedy


def _chunks(features, positions, valid, size: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Context in chunks of `size` slots, the last padded with invalid slots (at least one chunk): one static shape
    for compiled writes, whatever arrived."""
    pad = -features.shape[1] % size or (size if features.shape[1] == 0 else 0)
    if pad:
        features = F.pad(features, (0, 0, 0, pad))
        positions, valid = F.pad(positions, (0, pad)), F.pad(valid, (0, pad))
    dense = lambda t: t.clone(memory_format=torch.contiguous_format)  # noqa: E731  (same strides: no recompile)
    return [(dense(features[:, i:i + size]), dense(positions[:, i:i + size]), dense(valid[:, i:i + size]))
            for i in range(0, features.shape[1], size)]
