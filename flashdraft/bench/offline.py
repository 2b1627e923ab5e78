"""In-process benchmark: every method on the same prompts, interleaved prompt by prompt.

For each prompt, each method runs once (the method order rotates from prompt to prompt) so machine drift and
thermal or cache effects spread over all methods instead of biasing the ones that ran last. Every method gets one
short untimed warm-up first. With greedy decoding, each lossless method's output is compared token for token with
the target's own transformers `generate` on the same prompt (`reference.py`: unpacked weights, none of our fast
path). Every method is closed at the end (hooks off the target; the `zlab` method's process ended).

What this module does not know about: HTTP servers (`server.py`), tables and plots (`report.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch

from flashdraft.bench.datasets import dataset_label, load_prompts
from flashdraft.bench.methods import (ALL_METHODS, DRAFTER_METHODS, EngineMethod, Method, hf_assisted, hf_dflash,
                                      prompt_lookup)
from flashdraft.bench.metrics import acceptance_summary, prompt_distribution, timing_summary
from flashdraft.bench.reference import TARGET_GENERATE, first_difference, target_greedy_generate
from flashdraft.engine import EngineConfig, SamplingParams
from flashdraft.loading import DEFAULT_PAIR_DIR

DEFAULT_ASSISTANT = DEFAULT_PAIR_DIR / "assistant"


@dataclass
class BenchConfig:
    target: str | None = None
    draft: str | None = None
    assistant: str | None = None  # AR draft model for hf-assisted (default: the default pair's, when shipped)
    methods: list[str] = field(default_factory=lambda: list(ALL_METHODS))
    datasets: list[str] = field(default_factory=lambda: ["default"])
    num_prompts: int | None = 8
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = 0
    chat: bool = False
    ignore_eos: bool = False
    num_assistant_tokens: int = 5
    prompt_lookup_num_tokens: int = 10
    max_matching_ngram_size: int = 2
    device: str | None = "auto"
    dtype: str | None = "auto"
    draft_dtype: str | None = "auto"
    engine: EngineConfig = field(default_factory=EngineConfig)  # how `ar` and `dflash` run our engine
    cache_dir: str | None = None
    warmup: bool = True
    zlab_python: str | None = None  # the side environment of the `zlab` method (`zlab.zlab_python`)

    def to_json(self) -> dict:
        return asdict(self)


def sampling_params(cfg: BenchConfig, tokenizer) -> SamplingParams:
    stops = ()
    if not cfg.ignore_eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        stops = (int(tokenizer.eos_token_id),)
    return SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                          top_k=cfg.top_k, stop_token_ids=stops,
                          seed=cfg.seed if cfg.temperature > 0 else None)


def build_methods(names: list[str], target, tokenizer, drafter, params: SamplingParams, cfg: BenchConfig,
                  assistant=None) -> tuple[list[Method], list[str]]:
    """The requested methods (ar always first: it is the reference) and notes about any that had to be skipped."""
    methods: list[Method] = []
    notes = []
    names = ["ar"] + [n for n in names if n != "ar"]
    engine_variants = {"dflash": cfg.engine, "dflash-fixed": replace(cfg.engine, draft_policy="fixed"),
                       "dflash-chain": replace(cfg.engine, tree_budget=0, lookup_ngram=0),
                       "dflash-tree": replace(cfg.engine, lookup_ngram=0),
                       "dflash-drafter": replace(cfg.engine, lookup_splice=0, lookup_steps=0),
                       "dflash-no-lookup-steps": replace(cfg.engine, lookup_steps=0),
                       "dflash-no-trim": replace(cfg.engine, confidence_trim=False)}
    for name in names:
        if name == "ar":
            methods.append(EngineMethod("ar", target, None, tokenizer, params, cfg.engine.plain()))
        elif name in engine_variants:
            if drafter is None:
                raise ValueError(f"method {name} needs a drafter (--draft)")
            methods.append(EngineMethod(name, target, drafter, tokenizer, params, engine_variants[name]))
        elif name == "hf-dflash":
            from flashdraft.model.hf_export import transformers_dflash_available, unsupported_by_transformers_assistant

            if drafter is None:
                raise ValueError("method hf-dflash needs a drafter (--draft)")
            if not transformers_dflash_available():
                notes.append("hf-dflash skipped: this transformers has no built-in DFlash")
                continue
            reasons = unsupported_by_transformers_assistant(drafter)
            if reasons:
                notes.append("hf-dflash skipped: transformers' DFlash cannot run this drafter: " + "; ".join(reasons))
                continue
            if cfg.engine.block_size not in (None, drafter.block_size):
                notes.append(f"hf-dflash runs the drafter's own block size {drafter.block_size} "
                             f"(transformers has no block-size override)")
            methods.append(hf_dflash(target, drafter, tokenizer, params))
        elif name == "hf-assisted":
            if assistant is None:
                notes.append("hf-assisted skipped: no assistant model (--assistant DIR; train one with "
                             "`python -m flashdraft.bench.assistant`)")
                continue
            methods.append(hf_assisted(target, assistant, tokenizer, params, cfg.num_assistant_tokens))
        elif name == "zlab":
            method = _zlab_method(target, drafter, params, cfg)
            if isinstance(method, str):
                notes.append(method)
                continue
            methods.append(method)
        elif name == "prompt-lookup":
            methods.append(prompt_lookup(target, tokenizer, params, cfg.prompt_lookup_num_tokens,
                                         cfg.max_matching_ngram_size))
        else:
            raise ValueError(f"unknown method {name!r}; choose from {', '.join(ALL_METHODS)}")
    return methods, notes


def _zlab_method(target, drafter, params: SamplingParams, cfg: BenchConfig):
    """z-lab's package on the same checkpoints (`zlab.py`), or why it cannot run here (a note)."""
    from flashdraft.bench.zlab import ZlabMethod, zlab_python
    from flashdraft.loading import default_pair_paths

    if drafter is None:
        raise ValueError("method zlab needs a drafter (--draft)")
    python = zlab_python(cfg.zlab_python)
    if python is None:
        return ("zlab skipped: no side environment with z-lab's package (bash scripts/speed/setup_zlab_env.sh, or "
                "--zlab-python / $FLASHDRAFT_ZLAB_PYTHON)")
    kernel = max((layer.attention_conv.kernel_size for layer in drafter.layers if hasattr(layer, "attention_conv")),
                 default=0)
    if kernel > 2:
        # their convolution pads a block shorter than its kernel to the kernel's length and fails on the shapes
        return (f"zlab skipped: z-lab's dflash_generate stops with an error on DFlash2 drafters whose conv_kernel_size "
                f"({kernel}) exceeds 2, at any block shorter than the kernel (the last before max_new_tokens); "
                "their published checkpoints use 2")
    paths = (cfg.target, cfg.draft) if cfg.target is not None else default_pair_paths()
    # their loop cannot mix dtypes: target and drafter in the target's; their process gets as many threads as ours
    dtype = str(target.dtype).removeprefix("torch.")
    return ZlabMethod(python, str(paths[0]), str(cfg.draft or paths[1]), params, dtype, torch.get_num_threads(),
                      str(target.device))


def load_models(cfg: BenchConfig):
    """(target, tokenizer, drafter, assistant) on one device; the assistant only when hf-assisted is requested."""
    from flashdraft.loading import DEFAULT_TARGET, DefaultPairMissing, load_pair, load_target, resolve_device

    if any(m in DRAFTER_METHODS for m in cfg.methods):
        target, tokenizer, drafter = load_pair(cfg.target, cfg.draft, cfg.device, cfg.dtype, cfg.draft_dtype)
    else:  # no method drafts with a drafter: do not load one
        if cfg.target is None and not (DEFAULT_TARGET / "config.json").is_file():
            raise DefaultPairMissing(f"no default model shipped yet: {DEFAULT_TARGET} is missing; pass --target")
        target, tokenizer = load_target(cfg.target or DEFAULT_TARGET, cfg.device, cfg.dtype)
        drafter = None
    if tokenizer is None:
        raise ValueError("the target has no tokenizer; bench needs one to encode prompts")
    assistant = None
    if "hf-assisted" in cfg.methods:
        path = cfg.assistant
        if path is None and cfg.target is None and (DEFAULT_ASSISTANT / "config.json").is_file():
            path = str(DEFAULT_ASSISTANT)
        if path is not None:
            from transformers import AutoModelForCausalLM

            device = resolve_device(cfg.device)
            assistant = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype).to(device).eval()
            if assistant.config.vocab_size != target.config.vocab_size:
                raise ValueError(f"assistant vocab_size {assistant.config.vocab_size} != target vocab_size "
                                 f"{target.config.vocab_size}: hf-assisted needs a draft model sharing the "
                                 "target's tokenizer")
    return target, tokenizer, drafter, assistant


def run_offline(cfg: BenchConfig, target, tokenizer, drafter=None, assistant=None,
                extra_methods: list[Method] | None = None, progress=None, datasets: dict | None = None) -> dict:
    """Run the benchmark; returns the results dict (see report.py for its layout).

    `extra_methods`: more `Method` objects to run alongside (e.g. in tests, a deliberately broken one).
    `datasets`: {label: [Prompt]} to use instead of loading `cfg.datasets`.
    """
    import transformers

    transformers.logging.set_verbosity_error()
    params = sampling_params(cfg, tokenizer)
    methods, notes = build_methods(cfg.methods, target, tokenizer, drafter, params, cfg, assistant)
    methods += list(extra_methods or [])
    if datasets is None:
        datasets = {dataset_label(d): load_prompts(d, cfg.num_prompts, cfg.cache_dir) for d in cfg.datasets}
    encoded = {label: [p.encode(tokenizer, cfg.chat) for p in prompts] for label, prompts in datasets.items()}
    greedy = cfg.temperature == 0

    try:
        if cfg.warmup:
            first = next(iter(encoded.values()))[0]
            for m in methods:
                m.warmup()
                m.run(first, min(8, cfg.max_new_tokens))
        per_dataset = _run_prompts(cfg, target, params, methods, encoded, greedy, progress)
    finally:
        for m in methods:  # hooks off the target, the peer's process ended
            m.close()
    summary = _overall(methods, per_dataset)
    return {
        "mode": "offline",
        "config": cfg.to_json(),
        "notes": notes,
        "methods": [m.describe() for m in methods],
        "datasets": per_dataset,
        "summary": summary,
        "losslessness": _lossless_verdict(methods, per_dataset, greedy),
    }


def _run_prompts(cfg: BenchConfig, target, params: SamplingParams, methods: list[Method], encoded: dict,
                 greedy: bool, progress) -> dict:
    """Every method on every prompt, rotating the order; per dataset label the methods' summaries and records."""
    total = sum(len(v) for v in encoded.values()) * len(methods)
    task = progress.add_task("bench", total=total) if progress is not None else None
    per_dataset = {}
    for label, prompt_ids in encoded.items():
        records = {m.name: [] for m in methods}
        for i, ids in enumerate(prompt_ids):
            order = methods[i % len(methods):] + methods[:i % len(methods)]  # rotate: no method always runs last
            outputs = {}
            for m in order:
                if progress is not None:
                    progress.update(task, description=f"{label} {i + 1}/{len(prompt_ids)} {m.name}")
                out = m.run(ids, cfg.max_new_tokens)
                outputs[m.name] = out
                if progress is not None:
                    progress.advance(task)
            # the losslessness reference: the target's own transformers generate on its unpacked weights (untimed)
            ref = target_greedy_generate(target, ids, params) if greedy else None
            for m in methods:
                out = outputs[m.name]
                rec = {"index": i, "prompt_tokens": len(ids), "tokens": len(out.token_ids),
                       "wall_s": round(out.wall_time, 6), "ttft_s": round(out.ttft, 6),
                       "tau": round(sum(out.acceptance_lengths) / len(out.acceptance_lengths), 4)
                       if out.acceptance_lengths else None,
                       "acceptance_lengths": out.acceptance_lengths, "drafted": out.drafted,
                       "one_token_steps": out.one_token_steps, "lookup_steps": out.lookup_steps,
                       "lookup_accepted": out.lookup_accepted}
                if greedy and m.lossless:
                    first = first_difference(out.token_ids, ref)
                    rec["identical_to_target"] = first is None
                    if first is not None:
                        rec["first_difference_at"] = first
                if m.name in ("ar", "dflash") or not rec.get("identical_to_target", True):
                    rec["text"] = out.text
                records[m.name].append(rec)
        per_dataset[label] = {"num_prompts": len(prompt_ids), "methods": _summaries(methods, records)}
        for name, recs in records.items():
            per_dataset[label]["methods"][name]["prompts"] = recs
    return per_dataset


def _summaries(methods: list[Method], records: dict[str, list[dict]]) -> dict:
    out = {}
    for m in methods:
        recs = records[m.name]
        lengths = [a for r in recs for a in r["acceptance_lengths"]]
        drafted = [d for r in recs for d in r["drafted"]]
        s = {"lossless": m.lossless, **timing_summary(recs), **acceptance_summary(lengths, drafted, m.max_draft),
             "tau_per_prompt": prompt_distribution(recs), **_step_counts(recs)}
        checked = [r for r in recs if "identical_to_target" in r]
        s["mismatches"] = sum(not r["identical_to_target"] for r in checked) if checked else None
        s["mismatched_prompts"] = [r["index"] for r in checked if not r["identical_to_target"]]
        out[m.name] = s
    base = out.get("ar", {}).get("tokens_per_second")
    for s in out.values():
        s["speedup"] = round(s["tokens_per_second"] / base, 3) if base else None
    return out


def _step_counts(recs: list[dict]) -> dict:
    """One-token steps, the steps that verified a prompt-lookup continuation instead and its tokens accepted."""
    return {k: sum(r[k] for r in recs) for k in ("one_token_steps", "lookup_steps", "lookup_accepted")}


def _overall(methods: list[Method], per_dataset: dict) -> dict:
    """All datasets pooled, per method."""
    out = {}
    for m in methods:
        recs = [r for d in per_dataset.values() for r in d["methods"][m.name]["prompts"]]
        lengths = [a for r in recs for a in r["acceptance_lengths"]]
        drafted = [d for r in recs for d in r["drafted"]]
        mism = [d["methods"][m.name]["mismatches"] for d in per_dataset.values()]
        out[m.name] = {"lossless": m.lossless, **timing_summary(recs),
                       **acceptance_summary(lengths, drafted, m.max_draft),
                       "tau_per_prompt": prompt_distribution(recs), **_step_counts(recs),
                       "mismatches": None if any(x is None for x in mism) else sum(mism),
                       "num_prompts": len(recs)}
    base = out.get("ar", {}).get("tokens_per_second")
    for s in out.values():
        s["speedup"] = round(s["tokens_per_second"] / base, 3) if base else None
    return out


def _lossless_verdict(methods: list[Method], per_dataset: dict, greedy: bool) -> dict:
    if not greedy:
        return {"checked": False, "reason": "sampling (temperature > 0): outputs are not comparable token for token",
                "passed": None, "mismatches": {}}
    mism = {}
    for m in methods:
        if m.lossless:
            mism[m.name] = {label: d["methods"][m.name]["mismatched_prompts"] for label, d in per_dataset.items()}
    passed = all(not idx for per in mism.values() for idx in per.values())
    return {"checked": True, "passed": passed, "reference": TARGET_GENERATE,
            "mismatches": {name: sum(len(v) for v in per.values()) for name, per in mism.items()},
            "mismatched_prompts": mism}
