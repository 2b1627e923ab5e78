"""Runs z-lab's own `dflash` package (PyPI `dflash` 0.1.0) for `flashdraft bench --methods zlab` (`zlab.py`) and
scripts/speed/bench_zlab.py.

Runs with the SIDE environment's python (torch 2.13 CPU + `dflash[local]==0.1.0` + its pinned transformers 5.15),
never with ours: it imports only `dflash`, torch and transformers, and nothing from flashdraft (it is run as a
file, not imported).

    <side venv>/bin/python flashdraft/bench/zlab_runner.py --target T --draft D --threads 2 < requests.jsonl

Loading mirrors `dflash.benchmark.load_transformers_models` (AutoModelForCausalLM + `dflash.DFlashDraftModel
.from_pretrained`, attn_implementation="sdpa"; `dflash.DFlash2DraftModel` for a checkpoint whose config declares
that architecture, as their package reads it: DFlashDraftModel would load it without its convolutions and
selector and draft something else), except that it takes the device (`--device`, CPU by default) and
the dtype (`--dtype`, fp32 by default: their loader hard-codes bf16 and cuda:0). Generation is their
`dflash.model.dflash_generate`, unmodified; the only patch, on CPU, is `dflash.model._cuda_time` ->
`time.perf_counter` (it calls `torch.cuda.synchronize()`, which a CPU build refuses) so that `return_stats=True` hands back their acceptance
lengths. Timing is taken here, around each `dflash_generate` call (prefill included, as for every other method).

Protocol, one JSON object per line. Requests on stdin: {"cmd": "round", "prompts": [[ids...], ...],
"max_new_tokens": N, "block_size": B, "temperature": T, "top_p": P, "top_k": K, "seed": S, "stop_token_ids": [...]}
(B = 1 is their own plain decoding, as in `dflash benchmark`; the other fields are optional: greedy by default; with
a seed, torch's generator is seeded with it before each prompt; the target's EOS ids stop by default, [] never), {"cmd": "generate_hf", ...} (the target's own transformers greedy
`generate`, in their transformers), {"cmd": "quit"}. Replies on stdout: {"outputs": [[ids...]], "seconds": [...],
"ttft": [...] (their time to first token, None for generate_hf), "acceptance_lengths": [[...]]}. Logs go to
stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="float32", help="target and drafter dtype (their loop cannot mix dtypes)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    ap.add_argument("--info", action="store_true", help="print versions and where things come from, then exit")
    args = ap.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import dflash
    import dflash.model as zmodel

    if args.threads:
        torch.set_num_threads(args.threads)
    info = {"dflash_version": _version("dflash"), "dflash_file": dflash.__file__,
            "transformers": transformers.__version__, "torch": torch.__version__, "python": sys.executable,
            "threads": torch.get_num_threads()}
    dtype = getattr(torch, args.dtype)
    target = AutoModelForCausalLM.from_pretrained(args.target, attn_implementation="sdpa", dtype=dtype)
    draft = _draft_class(dflash, args.draft).from_pretrained(args.draft, attn_implementation="sdpa", dtype=dtype)
    target, draft = target.to(args.device).eval(), draft.to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    info.update(target_dtype=str(target.dtype), draft_dtype=str(draft.dtype), draft_class=type(draft).__qualname__,
                draft_module=type(draft).__module__, block_size=draft.block_size,
                mask_token_id=draft.mask_token_id, target_layer_ids=list(draft.target_layer_ids),
                target_linear=type(target.lm_head).__module__ + "." + type(target.lm_head).__qualname__)
    if target.device.type == "cpu":
        zmodel._cuda_time = time.perf_counter  # their timer calls torch.cuda.synchronize(); CPU has none
    eos = target.generation_config.eos_token_id or tokenizer.eos_token_id  # = dflash.benchmark.stop_token_ids
    stop = [eos] if isinstance(eos, int) else list(eos) if eos is not None else None
    info["stop_token_ids"] = stop
    _reply(info)
    if args.info:
        return 0

    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req["cmd"] == "quit":
            break
        outputs, seconds, ttft, acceptance = [], [], [], []
        for ids in req["prompts"]:
            input_ids = torch.tensor([ids], dtype=torch.long, device=target.device)
            if req.get("seed") is not None:
                torch.manual_seed(int(req["seed"]))
            t0 = time.perf_counter()
            if req["cmd"] == "round":
                res = zmodel.dflash_generate(draft, target, input_ids, req["max_new_tokens"],
                                             req.get("stop_token_ids", stop) or None,
                                             temperature=float(req.get("temperature", 0.0)),
                                             top_p=float(req.get("top_p", 1.0)), top_k=int(req.get("top_k", 0)),
                                             block_size=req.get("block_size"), return_stats=True)
                out, acc, first = res.output_ids, list(res.acceptance_lengths), res.time_to_first_token
            elif req["cmd"] == "generate_hf":
                out = target.generate(input_ids, max_new_tokens=req["max_new_tokens"], do_sample=False,
                                      eos_token_id=stop, pad_token_id=stop[0] if stop else 0)
                acc, first = [], None
            else:
                raise ValueError(f"unknown command {req['cmd']!r}")
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            seconds.append(time.perf_counter() - t0)
            ttft.append(first)
            outputs.append(out[0, len(ids):].tolist())
            acceptance.append(acc)
        _reply({"outputs": outputs, "seconds": seconds, "ttft": ttft, "acceptance_lengths": acceptance})
    return 0


def _draft_class(dflash, path):
    """Their drafter class for the checkpoint at `path` (a folder or a hub id): by its config's architectures."""
    from transformers import PretrainedConfig

    raw, _ = PretrainedConfig.get_config_dict(path)
    dflash2 = "DFlash2DraftModel" in (raw.get("architectures") or [])
    return dflash.DFlash2DraftModel if dflash2 else dflash.DFlashDraftModel


def _version(name):
    from importlib.metadata import version

    return version(name)


def _reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
