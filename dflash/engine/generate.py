"""The lossless generation engine: prefill, then cycles of draft -> verify -> accept -> commit.

One cycle for a batch of rows (DFLASH.md section 1):
1. draft   the proposer fills `[bonus, d_1 .. d_k]` at positions `n .. n+k` (k = block_size - 1);
2. verify  the target runs once over the block with its KV cache, capturing the tapped layers' features;
3. accept  the shared verifier returns per row the accepted count a and the next token;
4. commit  tokens `d_1..d_a, next` are appended; the block slots `0..a` stay in the target cache, the rest are
           rolled back. Rows accept different counts, so the cache is cropped to the longest kept prefix and the
           shorter rows' extra slots are masked out (`slot_mask`) - the cache holds holes, not copies. The
           features of the kept slots become the drafter's next context.
Finished rows leave the batch at once (their cache rows are dropped). Block size 1 with `NoProposer` is plain
autoregressive decoding through the same code: the baseline every speedup is measured against.

Positions are explicit per row (prompts are left-padded), so any transformers decoder that accepts
`position_ids` and a 2D attention mask works. Limitation: with batch > 1, targets whose attention uses a sliding
window count cache slots (holes included) rather than tokens, so they are exact only while the context fits the
window; batch 1 never has holes.

What this module does not know about: how drafts are made (`proposers.py`), how they are judged (`verify.py`),
HTTP, or continuous batching (the server drives `SpecEngine` one cycle at a time through the same functions).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from dflash.engine.proposers import DFlashProposer, NoProposer, ProposalInput
from dflash.engine.verify import SamplingParams, sample_tokens, verify
from dflash.model.drafter import DFlashDraftModel
from dflash.model.target import TargetModel, validate_pair


@dataclass
class RequestStats:
    """Acceptance and timing of one request. Acceptance length per cycle = accepted drafts + 1 (the bonus)."""

    block_size: int
    prompt_tokens: int
    output_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    time_to_first_token: float = 0.0
    decode_time: float = 0.0

    @property
    def tau(self) -> float:
        """Mean acceptance length (vLLM's 'mean acceptance length' = 1 + accepted / drafts)."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    @property
    def num_drafts(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(a - 1 for a in self.acceptance_lengths)

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


@dataclass
class StreamEvent:
    """New output of one request after a cycle. `text` is the newly decodable text (None without a tokenizer)."""

    index: int
    token_ids: list[int]
    text: str | None
    finished: bool
    result: GenerationResult | None = None


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
    text: str = ""
    emitted_tokens: int = 0
    emitted_chars: int = 0
    started: float = 0.0
    reported: bool = False

    @property
    def history(self) -> list[int]:
        return self.prompt + self.output


class SpecEngine:
    """Speculative generation for a transformers target with a drafting method (DFlash by default).

    engine = SpecEngine(target_model, drafter, tokenizer)
    results = engine.generate([ids_a, ids_b], SamplingParams(max_new_tokens=64))
    for event in engine.stream([ids], params): ...
    """

    def __init__(
        self,
        target: nn.Module | TargetModel,
        drafter: DFlashDraftModel | None = None,
        tokenizer=None,
        block_size: int | None = None,
        proposer=None,
    ):
        self.target = target if isinstance(target, TargetModel) else TargetModel(target)
        self.drafter = drafter
        self.tokenizer = tokenizer
        if proposer is not None:
            self.proposer = proposer
        elif drafter is not None and (block_size is None or block_size > 1):
            validate_pair(drafter, self.target)
            self.target.set_layer_ids(drafter.target_layer_ids)
            self.proposer = DFlashProposer(drafter, self.target)
        else:
            self.proposer = NoProposer()
        if isinstance(self.proposer, NoProposer):
            self.block_size = 1
        else:
            self.block_size = int(block_size or getattr(drafter, "block_size", 16))
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        self.pad_token_id = 0
        self.max_positions = getattr(self.target.config, "max_position_embeddings", None)

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
        rows = self._make_rows(prompts, params)
        with torch.inference_mode():
            state = self._prefill(rows)
            yield from self._events(rows)
            while state.rows:
                self._cycle(state)
                yield from self._events(rows)

    # ---- setup ----------------------------------------------------------------------------------------------

    def _make_rows(self, prompts, params) -> list[_Row]:
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
            if self.max_positions and len(prompt) + p.max_new_tokens > self.max_positions:
                raise ValueError(
                    f"prompt {i}: {len(prompt)} prompt tokens + max_new_tokens {p.max_new_tokens} exceed the "
                    f"target's context of {self.max_positions} positions"
                )
            gen = None
            if p.seed is not None:
                gen = torch.Generator(device=self.target.device).manual_seed(int(p.seed))
            rows.append(_Row(i, prompt, p, gen, RequestStats(self.block_size, len(prompt))))
        return rows

    def _prefill(self, rows: list[_Row]) -> "_BatchState":
        dev = self.target.device
        start = time.perf_counter()
        width = max(len(r.prompt) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long, device=dev)
        mask = torch.zeros((len(rows), width), dtype=torch.bool, device=dev)
        for i, r in enumerate(rows):
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt, device=dev)
            mask[i, width - len(r.prompt):] = True
        positions = (mask.long().cumsum(dim=1) - 1).clamp_min(0)
        cache = DynamicCache()
        logits, features = self.target.forward(
            ids, positions, mask.long(), cache, logits_to_keep=1, capture=self.proposer.needs_features
        )
        first = sample_tokens(logits[:, -1], [r.params for r in rows], [r.generator for r in rows])
        now = time.perf_counter()
        state = _BatchState(rows=list(rows), cache=cache, slot_mask=mask, features=features,
                            feature_positions=positions, feature_valid=mask)
        self.proposer.reset()
        for r, token in zip(rows, first.tolist()):
            r.n_cached = len(r.prompt)
            r.bonus = token
            r.started = start
            r.stats.time_to_first_token = now - start
            self._commit(r, [token])
        self._drop_finished(state)
        return state

    # ---- one cycle ------------------------------------------------------------------------------------------

    def _cycle(self, state: "_BatchState") -> None:
        rows, dev, k = state.rows, self.target.device, self.block_size - 1
        bonus = torch.tensor([r.bonus for r in rows], dtype=torch.long, device=dev)
        n_cached = torch.tensor([r.n_cached for r in rows], dtype=torch.long, device=dev)
        positions = n_cached[:, None] + torch.arange(self.block_size, device=dev)[None]
        drafts, draft_probs = self.proposer.propose(
            ProposalInput(bonus, positions, state.features, state.feature_positions, state.feature_valid,
                          [r.history for r in rows]),
            self.block_size,
        )
        block = torch.cat([bonus[:, None], drafts], dim=1)
        attention = torch.cat([state.slot_mask, torch.ones_like(block, dtype=torch.bool)], dim=1).long()
        logits, features = self.target.forward(
            block, positions, attention, state.cache, capture=self.proposer.needs_features
        )
        verdict = verify(logits, drafts, [r.params for r in rows], [r.generator for r in rows], draft_probs)

        kept = verdict.num_accepted + 1  # block slots 0..a stay in the cache
        width = int(kept.max())
        _truncate_cache(state.cache, state.slot_mask.shape[1] + width)
        kept_valid = torch.arange(width, device=dev)[None] < kept[:, None]
        state.slot_mask = torch.cat([state.slot_mask, kept_valid], dim=1)
        if features is not None:
            state.features = features[:, :width]
            state.feature_positions = positions[:, :width]
            state.feature_valid = kept_valid
        accepted = verdict.num_accepted.tolist()
        block_list = block.tolist()
        for r, a, nxt, blk in zip(rows, accepted, verdict.next_tokens.tolist(), block_list):
            r.stats.acceptance_lengths.append(a + 1)
            r.n_cached += a + 1
            r.bonus = nxt
            self._commit(r, blk[1:1 + a] + [nxt])
        self._drop_finished(state)

    def _commit(self, r: _Row, tokens: list[int]) -> None:
        """Append tokens to a row's output, applying max_new_tokens, stop ids and stop strings."""
        p = r.params
        for t in tokens:
            if len(r.output) >= p.max_new_tokens:
                break
            r.output.append(t)
            if t in p.stop_token_ids:
                r.finish_reason = "stop"
                break
        if r.finish_reason is None and len(r.output) >= p.max_new_tokens:
            r.finish_reason = "length"
        if self.tokenizer is not None:
            self._update_text(r)
        if r.finish_reason is not None:
            r.stats.output_tokens = len(r.output)
            r.stats.decode_time = time.perf_counter() - r.started - r.stats.time_to_first_token

    def _update_text(self, r: _Row) -> None:
        text = self.tokenizer.decode(r.output, skip_special_tokens=True)
        stops = r.params.stop_strings
        if stops:
            longest = max(map(len, stops))
            search_from = max(0, len(r.text) - longest)
            hits = [(text.find(s, search_from), s) for s in stops]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, s = min(hits)
                cut = pos + (len(s) if r.params.include_stop_str_in_output else 0)
                # keep the fewest tokens whose text reaches the end of the stop string
                need = pos + len(s)
                for n_tok in range(1, len(r.output) + 1):
                    if len(self.tokenizer.decode(r.output[:n_tok], skip_special_tokens=True)) >= need:
                        del r.output[n_tok:]
                        break
                text = text[:cut]
                r.finish_reason = "stop"
        r.text = text

    def _drop_finished(self, state: "_BatchState") -> None:
        keep = [i for i, r in enumerate(state.rows) if r.finish_reason is None]
        if len(keep) == len(state.rows):
            return
        state.rows = [state.rows[i] for i in keep]
        if not keep:
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.target.device)
        state.cache.batch_select_indices(idx)
        state.slot_mask = state.slot_mask.index_select(0, idx)
        if state.features is not None:
            state.features = state.features.index_select(0, idx)
            state.feature_positions = state.feature_positions.index_select(0, idx)
            state.feature_valid = state.feature_valid.index_select(0, idx)
        self.proposer.select_rows(idx)

    def _events(self, rows: list[_Row]) -> Iterator[StreamEvent]:
        for r in rows:
            finished = r.finish_reason is not None
            if r.reported or (r.emitted_tokens == len(r.output) and not finished):
                continue
            new_tokens = r.output[r.emitted_tokens:]
            r.emitted_tokens = len(r.output)
            text_delta = None
            if self.tokenizer is not None:
                stable = len(r.text) if finished else _stable_text_length(r.text, r.params.stop_strings)
                text_delta = r.text[r.emitted_chars:stable]
                r.emitted_chars = max(r.emitted_chars, stable)
            result = None
            if finished:
                r.reported = True
                result = GenerationResult(list(r.output), r.text if self.tokenizer else None, r.finish_reason, r.stats)
            yield StreamEvent(r.index, new_tokens, text_delta, finished, result)


def _stable_text_length(text: str, stop_strings: tuple[str, ...]) -> int:
    """How much of a growing text is final: hold back a partial UTF-8 character and a possible stop-string prefix."""
    end = len(text)
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    if stop_strings:
        end = max(0, min(end, len(text) - (max(map(len, stop_strings)) - 1)))
    return end


def _truncate_cache(cache: DynamicCache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


@dataclass
class _BatchState:
    rows: list[_Row]
    cache: DynamicCache
    slot_mask: torch.Tensor  # [b, S] which target cache slots hold real tokens of the row
    features: torch.Tensor | None  # target features of slots committed since the last draft
    feature_positions: torch.Tensor
    feature_valid: torch.Tensor
