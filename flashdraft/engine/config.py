"""`EngineConfig`: how `SpecEngine` runs, apart from which models it runs.

One frozen object for the options every entry point sets (the CLI's `engine_from_args`, the server, the bench
methods, training evals), checked once here, so a value that cannot work fails at construction with the option's
name. `SpecEngine(target, drafter, tokenizer, config)` takes it; keyword options override single fields
(`SpecEngine(target, drafter, block_size=8)`).

What this module does not know about: models, devices and whether the target has a fast path (the engine checks
those combinations when it is built).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashdraft.engine.lookup import MAX_NGRAM
from flashdraft.engine.policy import DRAFT_POLICIES
from flashdraft.model.slots import DEFAULT_PAGE_SIZE

SAMPLERS = ("gumbel", "rejection")


@dataclass(frozen=True)
class EngineConfig:
    # tokens verified per cycle: the bonus token + block_size - 1 drafts (None: the drafter's own block size)
    block_size: int | None = None
    # compiled draft and verify steps (torch.compile; CUDA graphs on GPU), batches padded to power-of-two buckets
    compile: bool = False
    # CPU: the widest projections through oneDNN on packed weight copies (None: when packable and small enough)
    pack_weights: bool | None = None
    # CPU, fp32 lm_head, fast path: verifies of greedy rows (and of sampled rows' race under counter-based noise)
    # read the target's argmax through a bf16 copy of the lm_head, certified to be the fp32 argmax
    # (`greedy_readout.py`; None: on a CPU with native bf16)
    screen_greedy: bool | None = None
    # how many tokens each row verifies per cycle (`policy.py`): "adaptive" = per row, what maximises the batch's
    # committed tokens per second under measured acceptance and costs (1 = a one-token step, no draft);
    # "fixed" = the whole block, every row, every cycle
    draft_policy: str = "adaptive"
    # batches of more than this many rows take one-token steps only (no drafts, no prompt-lookup continuations, no
    # probes), as plain decoding would: vLLM's `disable_by_batch_size`, a load above which a serving engineer knows
    # drafting does not pay on their hardware. The adaptive policy still decides below it. 0 = no limit
    disable_by_batch_size: int = 0
    # batch-invariant target forward: speculative output bit-identical to plain decoding (eager, fast path)
    exact: bool = False
    # the lean static-cache target path (None: when the architecture has one; False: transformers' own forward)
    fast_path: bool | None = None
    # record per-phase cycle times (`CycleProfiler`)
    profile: bool = False
    # how sampled rows (temperature > 0) are verified: "gumbel" = counter-based noise shared by drafter and target
    # (`noise.py`; the output equals plain decoding's with the same seed, whatever the drafter or batch);
    # "rejection" = speculative rejection sampling against argmax drafts
    sampler: str = "gumbel"
    # positions per page of the paged K/V caches (target and drafter): each row owns pages for the tokens it holds
    # (plus its next block), so memory follows the tokens held (`slots.PagedKV`)
    kv_page_size: int = DEFAULT_PAGE_SIZE
    # token trees (`tree.py`): 0 = verify the argmax chain; N = a tree of the N most likely draft nodes (best-first
    # by path probability) for every drafting row; "auto" = the size that maximises the batch's committed tokens
    # per second under the measured verify costs, per cycle. Eager fast path only (elsewhere: the chain)
    tree_budget: int | str = 0
    # requests that join a live batch through `SpecEngine.step(batch, prompts, ...)` with at most this many prompt
    # tokens in all ride the cycle's target forward beside the rows' blocks instead of a prefill forward of their
    # own (eager fast path, not exact, no trees; 0 = always apart). Longer prompts are prefilled apart: a long
    # prompt is compute-bound anyway, and riding it would stall every running row's cycle for it
    mixed_prefill_tokens: int = 512
    # automatic prefix caching (`prefix_cache.py`): up to this many positions of the full pages of prompts and
    # answers (the target's K/V and the features the drafter reads) kept, so a later prompt that starts with the same
    # tokens computes only the rest; least recently used pages leave first. Fast path outside exact mode; 0 = off
    prefix_cache_tokens: int = 0
    # with trees: a prompt-lookup branch in every drafting row's tree, the continuation of the latest earlier match
    # of the context's last n <= lookup_ngram tokens (0 = none)
    lookup_ngram: int = 0
    # chains: where the context's last n >= lookup_splice tokens occurred before and what followed them starts with
    # the drafter's first draft, that continuation replaces the rest of the row's drafts (`lookup.py`: prompt
    # lookup for the repeats a drafter starts and then loses; no model call). 0 = the drafter's chain alone
    lookup_splice: int = 4
    # rows the adaptive policy leaves at one-token steps (greedy and sampled): where the context's last
    # n >= lookup_steps tokens occurred before, the row verifies what followed them instead, as far as the policy's
    # price for each further token pays (`AdaptiveWidth.lookup_widths`: the row's own lookup acceptance against the
    # cost per verified token). Ragged verification only (the eager fast path). 0 = off
    lookup_steps: int = 4
    # the adaptive policy trims each drafting row's verify after the draft, to the width whose drafts' calibrated
    # confidence (the drafter's probability of each, `AdaptiveWidth.trim`) pays for verifying them. Ragged eager
    # verification with a DFlash drafter only; False: rows verify the width planned before the draft
    confidence_trim: bool = True
    # a DFlash2 selector whose candidates are the whole vocabulary walks among each block position's K likeliest
    # winners (`dflash2_proposer.py`; None: its default, 16; 0: every token, as z-lab's package walks)
    walk_candidates: int | None = None
    # CPU: sampled rows' counter-based noise (and their race offsets) made on a thread of its own while the target
    # forward runs, in cycles where no sampled row drafts (their noise is then read only at the read-out). None:
    # where the process may use more cores than torch's threads (one torch thread on a 2-core machine)
    noise_thread: bool | None = None
    # CUDA: let torch's attention pick cuDNN's backend too. Off by default: cuDNN plans a graph for every new
    # attention shape, and drafting cycles rarely repeat one (`kernels.py`); no effect on CPU
    cudnn_attention: bool = False

    def __post_init__(self):
        def integer(value) -> bool:  # a bool is an int to Python, not a size to us
            return isinstance(value, int) and not isinstance(value, bool)

        if self.block_size is not None and (not integer(self.block_size) or self.block_size < 1):
            raise ValueError(f"block_size must be an integer >= 1 (or None for the drafter's), got {self.block_size!r}")
        if not integer(self.kv_page_size) or self.kv_page_size < 1:
            raise ValueError(f"kv_page_size must be an integer >= 1, got {self.kv_page_size!r}")
        if not (self.tree_budget == "auto" or (integer(self.tree_budget) and 0 <= self.tree_budget <= 512)):
            raise ValueError(f"tree_budget must be 'auto' or an integer in [0, 512], got {self.tree_budget!r}")
        if not integer(self.mixed_prefill_tokens) or self.mixed_prefill_tokens < 0:
            raise ValueError(f"mixed_prefill_tokens must be an integer >= 0, got {self.mixed_prefill_tokens!r}")
        if not integer(self.prefix_cache_tokens) or self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be an integer >= 0, got {self.prefix_cache_tokens!r}")
        if not integer(self.disable_by_batch_size) or self.disable_by_batch_size < 0:
            raise ValueError(f"disable_by_batch_size must be an integer >= 0 (0: no limit), "
                             f"got {self.disable_by_batch_size!r}")
        if not integer(self.lookup_ngram) or not 0 <= self.lookup_ngram <= 16:
            raise ValueError(f"lookup_ngram must be an integer in [0, 16], got {self.lookup_ngram!r}")
        if not integer(self.lookup_splice) or not 0 <= self.lookup_splice <= MAX_NGRAM:
            raise ValueError(f"lookup_splice must be an integer in [0, {MAX_NGRAM}], got {self.lookup_splice!r}")
        if not integer(self.lookup_steps) or not 0 <= self.lookup_steps <= MAX_NGRAM:
            raise ValueError(f"lookup_steps must be an integer in [0, {MAX_NGRAM}], got {self.lookup_steps!r}")
        if self.walk_candidates is not None and (not integer(self.walk_candidates) or self.walk_candidates < 0):
            raise ValueError(f"walk_candidates must be an integer >= 0 (0: every token), got {self.walk_candidates!r}")
        if not isinstance(self.confidence_trim, bool):
            raise ValueError(f"confidence_trim must be True or False, got {self.confidence_trim!r}")
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"draft_policy must be one of {DRAFT_POLICIES}, got {self.draft_policy!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if self.exact and self.compile:
            raise ValueError("exact=True runs eager steps; it cannot be combined with compile=True")
        if not isinstance(self.cudnn_attention, bool):
            raise ValueError(f"cudnn_attention must be True or False, got {self.cudnn_attention!r}")
        if self.noise_thread is not None and not isinstance(self.noise_thread, bool):
            raise ValueError(f"noise_thread must be True, False or None, got {self.noise_thread!r}")
        if self.screen_greedy is not None and not isinstance(self.screen_greedy, bool):
            raise ValueError(f"screen_greedy must be True, False or None, got {self.screen_greedy!r}")
        if self.exact and self.fast_path is False:
            raise ValueError("exact=True needs the fast target path; it cannot be combined with fast_path=False")

    def plain(self) -> "EngineConfig":
        """The same engine without drafting: the plain-decoding baseline a speedup is measured against."""
        from dataclasses import replace

        return replace(self, block_size=None)
