"""The decoding methods a benchmark compares, behind one interface: `method.run(prompt_ids) -> RunOutput`.

- `ar`            plain autoregressive decoding through `SpecEngine` (no drafter): the baseline of every speedup.
- `dflash`        `SpecEngine` with the DFlash drafter (this project), the engine's draft policy (adaptive unless
                  `--draft-policy fixed`).
- `dflash-fixed`  the same with the fixed policy: the whole block verified every cycle (what the policy replaced).
- `dflash-chain`  the same without token trees (`--tree-budget 0`, no lookup branch): what trees are measured against.
- `dflash-tree`   the same trees without the prompt-lookup branch (`--lookup-ngram 0`): with `dflash` run with
                  `--lookup-ngram N`, the drafter's tree alone beside the mix.
- `dflash-drafter` the same without prompt lookup (`--lookup-splice 0 --lookup-steps 0`): the drafter's own
                  chain, what lookup is measured against.
- `dflash-no-lookup-steps` the same without lookup continuations at one-token steps (`--lookup-steps 0`).
- `dflash-no-trim` the same verifying the widths the policy planned before the draft (`--no-confidence-trim`).
- `hf-dflash`     transformers' built-in DFlash loop (`speculation_type="dflash"`, batch 1) with our drafter's
                  weights (`flashdraft.model.hf_export`).
- `hf-assisted`   transformers assisted generation with a small autoregressive draft model (`assistant.py`),
                  a fixed number of draft tokens per cycle (`num_assistant_tokens`, schedule "constant",
                  confidence threshold 0: no early stop of the draft), so every cycle is comparable.
- `prompt-lookup` transformers' prompt-lookup decoding (`prompt_lookup_num_tokens`): n-gram copies from the prompt.
- `zlab`          z-lab's own `dflash` package (`dflash_generate`, batch 1) in a side environment (`zlab.py`), on the
                  same target and drafter directories.

Each run returns the new token ids, wall time, time to first token and, per verification cycle that carried
drafts, the acceptance length (accepted drafts + 1 bonus) and the number of drafted tokens. For transformers'
methods these come from wrapping the candidate generator `generate` builds (`get_candidates` gives the draft
length, `update_candidate_strategy` the number of matches) and from a streamer (first-token time).

What this module does not know about: prompts, aggregation, output (see `offline.py`, `report.py`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from flashdraft.engine import EngineConfig, SamplingParams, SpecEngine

LOSSLESS_METHODS = ("ar", "dflash", "dflash-fixed", "dflash-chain", "dflash-tree", "dflash-drafter",
                    "dflash-no-lookup-steps", "dflash-no-trim", "hf-dflash", "hf-assisted", "prompt-lookup", "zlab")
ALL_METHODS = LOSSLESS_METHODS
DRAFTER_METHODS = ("dflash", "dflash-fixed", "dflash-chain", "dflash-tree", "dflash-drafter", "dflash-no-lookup-steps",
                   "dflash-no-trim", "hf-dflash", "zlab")  # need one
# side-by-side variants, and the peer that needs a side environment
ON_REQUEST_METHODS = ("dflash-fixed", "dflash-chain", "dflash-tree", "dflash-drafter", "dflash-no-lookup-steps",
                      "dflash-no-trim", "zlab")
DEFAULT_METHODS = tuple(m for m in ALL_METHODS if m not in ON_REQUEST_METHODS)


@dataclass
class RunOutput:
    token_ids: list[int]
    wall_time: float
    ttft: float
    acceptance_lengths: list[int] = field(default_factory=list)  # per cycle with drafts: accepted + 1
    drafted: list[int] = field(default_factory=list)  # per cycle with drafts: number of draft tokens verified
    text: str | None = None
    one_token_steps: int = 0  # decoding steps without a draft (our engine's draft policy)
    lookup_steps: int = 0  # steps the policy left without a draft that verified a prompt-lookup continuation
    lookup_accepted: int = 0  # the continuations' tokens accepted


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Method:
    """A decoding method. `lossless`: its greedy output must equal `ar`'s. `max_draft`: drafts per cycle (0 = none)."""

    name: str = "?"
    lossless: bool = True
    max_draft: int = 0

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        raise NotImplementedError

    def warmup(self) -> None:
        """Get ready before anything is timed (beside an untimed short run)."""

    def describe(self) -> dict:
        return {"name": self.name, "lossless": self.lossless, "max_draft_tokens": self.max_draft}

    def close(self) -> None:
        """Release what the method holds on the target (hooks, packed weight copies); idempotent."""


class EngineMethod(Method):
    """`ar` or `flashdraft`: our engine, batch 1."""

    def __init__(self, name: str, target, drafter, tokenizer, params: SamplingParams,
                 config: EngineConfig | None = None):
        self.name = name
        self.engine = SpecEngine(target, drafter, tokenizer, config)
        self.params = params
        self.max_draft = self.engine.block_size - 1
        self.device = self.engine.target.device

    def describe(self) -> dict:
        # which configuration ran, and which target forward
        return {**super().describe(), "engine": asdict(self.engine.config), "target_path": self.engine.target_path}

    def warmup(self) -> None:
        self.engine.warmup(1)  # as `flashdraft serve` does: every width's kernels run and the policy's costs are timed

    def run(self, prompt_ids, max_new_tokens):
        params = SamplingParams(**{**self.params.__dict__, "max_new_tokens": max_new_tokens})
        t0 = time.perf_counter()
        res = self.engine.generate([prompt_ids], params)[0]
        _sync(self.device)
        wall = time.perf_counter() - t0
        lengths = list(res.stats.acceptance_lengths) if self.max_draft else []
        drafted = [w - 1 for w in res.stats.verify_widths] if self.max_draft else []
        return RunOutput(list(res.token_ids), wall, res.stats.time_to_first_token, lengths, drafted, res.text,
                         res.stats.plain_steps if self.max_draft else 0,
                         res.stats.lookup_steps, res.stats.lookup_accepted)

    def close(self) -> None:
        self.engine.close()


class _FirstTokenTimer:
    """A `generate` streamer that only notes when the first new tokens arrive (the first `put` is the prompt)."""

    def __init__(self, device):
        self.device = device
        self.calls = 0
        self.first = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self):
        pass


class HFMethod(Method):
    """A transformers `generate` speculative mode, batch 1."""

    def __init__(self, name: str, target, tokenizer, params: SamplingParams, max_draft: int, **generate_kwargs):
        self.name = name
        self.target = target
        self.tokenizer = tokenizer
        self.params = params
        self.max_draft = max_draft
        self.kwargs = generate_kwargs
        self.device = target.device

    def _sampling_kwargs(self) -> dict:
        p = self.params
        eos = list(p.stop_token_ids) or None
        pad = p.stop_token_ids[0] if p.stop_token_ids else 0
        kw = {"eos_token_id": eos, "pad_token_id": pad}
        if p.greedy:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kw.update(do_sample=True, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or None)
        return kw

    @torch.inference_mode()
    def run(self, prompt_ids, max_new_tokens):
        cycles: list[list[int]] = []  # [draft length, matches]
        model = self.target
        original = type(model)._get_candidate_generator

        def wrapped(*args, **kwargs):
            gen = original(model, *args, **kwargs)
            get, update = gen.get_candidates, gen.update_candidate_strategy

            def get_candidates(input_ids, *a, **k):
                ids, logits = get(input_ids, *a, **k)
                cycles.append([int(ids.shape[1] - input_ids.shape[1]), 0])
                return ids, logits

            def update_candidate_strategy(input_ids, scores, num_matches):
                if cycles:
                    cycles[-1][1] = int(num_matches)
                return update(input_ids, scores, num_matches)

            gen.get_candidates = get_candidates
            gen.update_candidate_strategy = update_candidate_strategy
            return gen

        if self.params.seed is not None:
            torch.manual_seed(self.params.seed)
        ids = torch.tensor([prompt_ids], device=self.device)
        timer = _FirstTokenTimer(self.device)
        model._get_candidate_generator = wrapped
        try:
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 streamer=timer, **self._sampling_kwargs(), **self.kwargs)
            _sync(self.device)
            wall = time.perf_counter() - t0
        finally:
            del model._get_candidate_generator
        new = out[0, len(prompt_ids):].tolist()
        drafted = [c for c in cycles if c[0] > 0]
        text = self.tokenizer.decode(new, skip_special_tokens=True) if self.tokenizer is not None else None
        return RunOutput(new, wall, (timer.first or time.perf_counter()) - t0, [m + 1 for _, m in drafted],
                         [d for d, _ in drafted], text)


def hf_dflash(target, drafter, tokenizer, params: SamplingParams) -> HFMethod:
    from flashdraft.model.hf_export import to_transformers_assistant

    assistant = to_transformers_assistant(drafter, dtype=target.dtype)
    return HFMethod("hf-dflash", target, tokenizer, params, max_draft=drafter.block_size - 1,
                    assistant_model=assistant, speculation_type="dflash")


def hf_assisted(target, assistant, tokenizer, params: SamplingParams, num_assistant_tokens: int = 5) -> HFMethod:
    # transformers reads these from the assistant's generation config (not from generate's kwargs)
    gc = assistant.generation_config
    gc.num_assistant_tokens = int(num_assistant_tokens)
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0
    return HFMethod("hf-assisted", target, tokenizer, params, max_draft=int(num_assistant_tokens),
                    assistant_model=assistant)


def prompt_lookup(target, tokenizer, params: SamplingParams, num_tokens: int = 10, max_ngram: int = 2) -> HFMethod:
    return HFMethod("prompt-lookup", target, tokenizer, params, max_draft=int(num_tokens),
                    prompt_lookup_num_tokens=int(num_tokens), max_matching_ngram_size=int(max_ngram))
