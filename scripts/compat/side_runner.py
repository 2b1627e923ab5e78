"""Runs ANOTHER DFlash stack on a target + drafter directory, for scripts/compat/zlab_roundtrip.py.

Runs with a side environment's python and imports nothing from flashdraft:

- `--mode zlab`: z-lab's own package (PyPI `dflash` 0.1.0, transformers 5.15): the drafter through
  `dflash.DFlashDraftModel.from_pretrained` (`dflash.DFlash2DraftModel` for a config naming that architecture;
  its drafts are then the candidate selector's), decoding with their `dflash.model.dflash_generate`, unmodified (their
  CUDA timer is swapped for `time.perf_counter` on CPU, as in flashdraft/bench/zlab_runner.py).
- `--mode remote`: the remote-code line of z-lab's hub checkpoints, `AutoModel.from_pretrained(drafter,
  trust_remote_code=True)` (the `dflash.py` beside the weights), decoding with its `spec_generate`; meant for a
  transformers 4.57 environment.

The target is `AutoModelForCausalLM.from_pretrained(target)` in both. Greedy, batch 1, no stop ids. Reads one JSON
request on stdin: {"prompts": [[ids]], "max_new_tokens": N, "save_to": optional dir (zlab mode: their
`save_pretrained` of the loaded drafter, i.e. their checkpoint layout), "init_dflash2": optional {DFlash2 fields,
num_hidden_layers, seed} (zlab mode: the drafter directory is first CREATED by their class, randomly initialised,
`_init_dflash2`)}. Writes one JSON object on stdout: versions, what the drafter read (rope base, dtype, block size, taps), and per prompt the output ids, the acceptance lengths
(tokens committed per cycle, bonus included) and the drafted tokens of every cycle.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["zlab", "remote"], required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokenizer", default=None, help="also load this tokenizer directory and encode a probe")
    args = ap.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    req = json.loads(sys.stdin.read() or "{}")
    dtype = getattr(torch, args.dtype)
    info = {"mode": args.mode, "transformers": transformers.__version__, "torch": torch.__version__,
            "python": sys.executable}
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, attn_implementation="sdpa").eval()
    drafts: list[list[int]] = []

    if args.mode == "zlab":
        import dflash
        import dflash.model as zmodel
        from importlib.metadata import version

        info.update(dflash_version=version("dflash"), dflash_file=dflash.__file__)
        if req.get("init_dflash2"):
            info["initialised"] = _init_dflash2(dflash.DFlash2DraftModel, target.config, args.draft,
                                                req["init_dflash2"])
        with open(f"{args.draft}/config.json") as f:
            archs = json.load(f).get("architectures") or []
        cls = dflash.DFlash2DraftModel if "DFlash2DraftModel" in archs else dflash.DFlashDraftModel
        draft = cls.from_pretrained(args.draft, dtype=dtype, attn_implementation="sdpa").eval()
        zmodel._cuda_time = time.perf_counter  # their timer calls torch.cuda.synchronize(); CPU has none
        if cls is dflash.DFlash2DraftModel:  # drafts come from the candidate selector's walk
            _record(draft, "propose", drafts, lambda out: out[0][0].tolist())
        else:
            _record(draft, "compute_logits", drafts, lambda logits: logits[0].argmax(-1).tolist())

        def generate(ids, n):
            res = zmodel.dflash_generate(draft, target, ids, n, None, temperature=0.0, return_stats=True)
            return res.output_ids, list(res.acceptance_lengths)
    else:
        draft = AutoModel.from_pretrained(args.draft, trust_remote_code=True, dtype=dtype).eval()
        info["draft_module"] = type(draft).__module__
        _record(draft, "compute_logits", drafts, lambda logits: logits[0].argmax(-1).tolist())

        def generate(ids, n):
            res = draft.spec_generate(target, ids, n, None, temperature=0.0, return_stats=True)
            return res.output_ids, list(res.acceptance_lengths)

    rope_cfg = draft.config
    info.update(
        draft_class=type(draft).__qualname__, draft_dtype=str(next(draft.parameters()).dtype),
        block_size=int(draft.block_size), target_layer_ids=[int(i) for i in draft.target_layer_ids],
        rope_theta_read=_rope_theta(rope_cfg),
        inv_freq_1=float(draft.rotary_emb.inv_freq[1]) if draft.rotary_emb.inv_freq.numel() > 1 else None,
        target_rope_theta_read=_rope_theta(target.config),
    )
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        probe = "def f(x):\n    return x + 1\n"
        info["tokenizer"] = {"class": type(tok).__name__, "probe_ids": tok(probe)["input_ids"],
                             "decoded": tok.decode(tok(probe)["input_ids"])}
    results = []
    for prompt in req.get("prompts", []):
        drafts.clear()
        ids = torch.tensor([prompt], dtype=torch.long)
        out, acc = generate(ids, int(req["max_new_tokens"]))
        results.append({"output": out[0, len(prompt):].tolist(), "acceptance_lengths": acc,
                        "drafts": [list(d) for d in drafts]})
    info["results"] = results
    if req.get("save_to") and args.mode == "zlab":
        for name in ("propose", "compute_logits"):  # the class's own methods again, not the recording wrappers
            draft.__dict__.pop(name, None)
        draft.save_pretrained(req["save_to"])
        info["saved_to"] = req["save_to"]
    sys.stdout.write(json.dumps(info) + "\n")
    return 0


def _record(draft, method: str, drafts: list, tokens) -> None:
    """Wrap `draft.<method>` (as an instance attribute; popping it from `draft.__dict__` undoes that) so that each
    call appends the drafted tokens, `tokens(its result)`, to `drafts`."""
    original = getattr(draft, method)

    def recording(*args):
        out = original(*args)
        drafts.append(tokens(out))
        return out

    setattr(draft, method, recording)


def _init_dflash2(cls, target_config, out: str, spec: dict) -> list[str]:
    """A randomly initialised DFlash2 drafter built by z-lab's own class for this target, saved by their
    `save_pretrained` and then renamed to the layout of their published checkpoints (codebooks without `.weight`).
    Their class leaves the convolutions' static kernels uninitialised (torch.empty): they, the dynamic kernels and
    the selector's projection get random values large enough that both change what is drafted."""
    import os

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3Config

    torch.manual_seed(int(spec.get("seed", 0)))
    names = ("mask_token_id", "target_layer_ids", "block_size", "selector_rank", "selector_top_k", "conv_kernel_size",
             "conv_group_size")
    cfg = Qwen3Config(
        vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size, num_hidden_layers=int(spec["num_hidden_layers"]),
        num_attention_heads=target_config.num_attention_heads, num_key_value_heads=target_config.num_key_value_heads,
        head_dim=getattr(target_config, "head_dim", None), rms_norm_eps=target_config.rms_norm_eps,
        max_position_embeddings=target_config.max_position_embeddings,
        rope_parameters=dict(target_config.rope_parameters), architectures=["DFlash2DraftModel"],
        num_target_layers=target_config.num_hidden_layers, dflash_config={k: spec[k] for k in names})
    draft = cls(cfg)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("base_kernel"):
                param.normal_(0, 0.5)
            elif "kernel_projection" in name:
                param.normal_(0, 0.3)
            elif "hidden_projection" in name:
                param.normal_(0, 2.0)
    draft.save_pretrained(out)
    path = os.path.join(out, "model.safetensors")
    state = load_file(path)
    state = {k.removesuffix(".weight") if "_codebook" in k else k: v for k, v in state.items()}
    save_file(state, path, metadata={"format": "pt"})
    return sorted(state)


def _rope_theta(config):
    rope = getattr(config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope.get("rope_theta") is not None:
        return float(rope["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    return float(theta) if theta is not None else None


if __name__ == "__main__":
    sys.exit(main())
