"""Round trip between our drafters and other DFlash stacks, drafts compared cycle by cycle.

    bash scripts/speed/setup_zlab_env.sh      # once: z-lab's package (dflash 0.1.0, transformers 5.15) side venv
    bash scripts/compat/setup_tf457_env.sh    # optional: a transformers 4.57 side venv (the remote-code line)
    python scripts/compat/zlab_roundtrip.py --out runs/compat/roundtrip --json runs/compat/roundtrip.json
    python scripts/compat/zlab_roundtrip.py --arch dflash2 --out runs/compat/roundtrip --json runs/compat/dflash2.json
    python scripts/compat/zlab_roundtrip.py --arch dflash2 --selector-top-k 0 ...   # every token a candidate

1. Trains a drafter (`--arch`: DFlash-1, or DFlash2 as `flashdraft train --arch dflash2` does) with our training
   pipeline (`Trainer`, the code `flashdraft train` runs: regenerated target answers, exported with
   `save_pretrained`) for a tiny Qwen3 target whose rope base is 1e6 (as Qwen3-8B's), on arithmetic progressions
   (`flashdraft.train.synthetic`).
2. Ours: our engine drafts and verifies on held-out prompts (greedy, batch 1); per prompt we keep the acceptance
   length and the drafted tokens of every cycle.
3. z-lab: their package loads our export with `dflash.DFlashDraftModel.from_pretrained` (`DFlash2DraftModel`) and
   decodes with their
   `dflash_generate` (`side_runner.py --mode zlab`); same figures.
4. Their layout: their `save_pretrained` of that drafter, loaded by our `from_pretrained`, decoded by our engine.
5. Control: the same export with the rope base dropped from config.json (what a transformers-4.57 reader made of our
   old export: 1e4), through their package; it drafts differently and tau drops.
5b. DFlash2 only: a random DFlash2 drafter built and saved by THEIR class (their published layout) decodes in ours
   and in their `dflash_generate`.
6. DFlash-1 only, with a transformers-4.57 side venv: `AutoModel.from_pretrained(export, trust_remote_code=True)`
   (our dflash.py) decodes with its `spec_generate`; it must read rope base 1e6 and draft as ours. It also loads the shipped
   target's tokenizer under 4.57.

"Equal" means: same outputs, same number of cycles, the same acceptance length in every cycle but the last (z-lab's
loop truncates its last block at max_new_tokens, ours verifies a full one), and the same drafted tokens in every
cycle (over the length both drafted). Prints a table and writes --json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SIDE = HERE / "side_runner.py"
ZLAB_PYTHON = Path(os.environ.get("FLASHDRAFT_ZLAB_PYTHON", Path.home() / ".cache/flashdraft/venv-zlab/bin/python"))
TF457_PYTHON = Path(os.environ.get("FLASHDRAFT_TF457_PYTHON",
                                   Path.home() / ".cache/flashdraft/venv-tf457/bin/python"))
SHIPPED_TARGET = ROOT / "flashdraft" / "assets" / "default_pair" / "target"


# DFlash2 options of the drafters trained here (the target's hidden size is 32)
DFLASH2_OPTIONS = {"selector_rank": 8, "selector_top_k": 4, "conv_kernel_size": 3, "conv_group_size": 8}
TINY_VOCAB = 64  # the target's


def build_pair(out: Path, rope_theta: float = 1e6, target_steps: int = 150, draft_steps: int = 400,
               seed: int = 0, arch: str = "dflash", dflash2_options: dict | None = None
               ) -> tuple[Path, Path, list[list[int]]]:
    """A tiny Qwen3 target (rope base `rope_theta`) and a drafter of `arch` (dflash | dflash2) trained for it by our
    pipeline, both on disk; returns (target_dir, drafter_dir, held-out prompts). A target and regenerated data
    already in `out` (an earlier call) are reused."""
    import torch
    from transformers import AutoModelForCausalLM

    from flashdraft.train.regenerate import regenerate
    from flashdraft.train.data import load_examples
    from flashdraft.train.synthetic import BOS, MASK, progression, tiny_target_config, train_tiny_target
    from flashdraft.train.trainer import TrainConfig, Trainer

    def prompts(n, s):
        g = torch.Generator().manual_seed(s)
        res = []
        for _ in range(n):
            a = int(torch.randint(60, (1,), generator=g))
            d = (1, 2, 3)[int(torch.randint(3, (1,), generator=g))]
            res.append([BOS] + progression(a, d, int(torch.randint(3, 8, (1,), generator=g)), 60))
        return res

    target_dir, regen = out / "target", out / "regen"
    if (target_dir / "config.json").is_file() and (regen / "done").is_file():
        target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    else:
        torch.manual_seed(seed)
        cfg = tiny_target_config(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, heads=2, kv_heads=1,
                                 num_layers=4)
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": float(rope_theta)}
        target = train_tiny_target(cfg, steps=target_steps, batch_size=16, length=32, lr=5e-3, seed=seed)
        target.save_pretrained(target_dir)
        # hub configs of Qwen3 targets carry rope_theta at top level too; a transformers-4.57 reader needs it
        tcfg = json.loads((target_dir / "config.json").read_text())
        tcfg["rope_theta"] = float(rope_theta)
        (target_dir / "config.json").write_text(json.dumps(tcfg, indent=2))
        if regen.exists():
            shutil.rmtree(regen)
        regenerate(target, prompts(256, seed + 1), regen, shard_size=64, batch_size=64, max_new_tokens=40,
                   stop_ids=[0], progress=False)
        (regen / "done").write_text("")
    options = dflash2_options or DFLASH2_OPTIONS
    run = out / ("run" if arch == "dflash" else f"run_{arch}" if options == DFLASH2_OPTIONS else
                 f"run_{arch}_top{options['selector_top_k']}")
    if run.exists():
        shutil.rmtree(run)
    tc = TrainConfig(output_dir=str(run), block_size=8, num_draft_layers=2, mask_token_id=MASK, max_steps=draft_steps,
                     batch_size=8, num_anchors=16, lr=2e-3, save_every=max(draft_steps, 1), eval_at_start=False,
                     eval_every=0, eval_max_new_tokens=32, progress=False, seed=seed, export_dtype="float32",
                     arch=arch, **(options if arch == "dflash2" else {}))
    Trainer(tc, target_model=target, examples=load_examples(regen), eval_prompts=prompts(4, seed + 3)).train()
    return target_dir, run / "final", prompts(16, seed + 2)


def run_ours(target_dir: Path, draft_dir: Path, prompts, max_new_tokens: int, dtype: str = "float32") -> dict:
    """Our engine on the pair: per prompt output, acceptance lengths and drafts per cycle."""
    import torch
    from transformers import AutoModelForCausalLM

    from flashdraft import SamplingParams, SpecEngine
    from flashdraft.engine.proposers import DFlashProposer
    from flashdraft.loading import load_drafter

    dt = getattr(torch, dtype)
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dt).eval()
    drafter = load_drafter(draft_dir, dtype=dt)  # DFlash-1 or DFlash2, by the config's architecture
    drafts: list[list[int]] = []
    original = DFlashProposer.propose

    def record(self, state, inp, block_size):
        out, probs = original(self, state, inp, block_size)
        drafts.append(out[0].tolist())
        return out, probs

    DFlashProposer.propose = record
    results = []
    try:
        # cycle by cycle the drafter's own chain, as their loop drafts (no prompt-lookup splice)
        # every token walked where every token is a candidate, as their package walks
        engine = SpecEngine(target, drafter, draft_policy="fixed", lookup_splice=0, walk_candidates=0)
        for prompt in prompts:
            drafts.clear()
            res = engine.generate([prompt], SamplingParams(max_new_tokens=max_new_tokens))[0]
            results.append({"output": res.token_ids, "acceptance_lengths": list(res.stats.acceptance_lengths),
                            "drafts": [list(d) for d in drafts]})
    finally:
        DFlashProposer.propose = original
    theta = (drafter.config.rope_parameters or {}).get("rope_theta")
    return {"results": results, "rope_theta_read": theta, "inv_freq_1": float(drafter.rotary_emb.inv_freq[1])}


def run_side(python: Path, mode: str, target_dir: Path, draft_dir: Path, prompts, max_new_tokens: int,
             dtype: str = "float32", save_to: Path | None = None, tokenizer: Path | None = None,
             timeout: int = 900, init_dflash2: dict | None = None) -> dict:
    """`side_runner.py` in another environment; `init_dflash2`: their class first creates `draft_dir`, randomly
    initialised (DFlash2 fields + num_hidden_layers + seed)."""
    target_dir, draft_dir = Path(target_dir).resolve(), Path(draft_dir).resolve()
    save_to = Path(save_to).resolve() if save_to else None
    cmd = [str(python), str(SIDE), "--mode", mode, "--target", str(target_dir), "--draft", str(draft_dir),
           "--dtype", dtype]
    if tokenizer:
        cmd += ["--tokenizer", str(Path(tokenizer).resolve())]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["HF_HUB_OFFLINE"] = "1"
    req = {"prompts": prompts, "max_new_tokens": max_new_tokens, "save_to": str(save_to) if save_to else None,
           "init_dflash2": init_dflash2}
    Path(draft_dir).parent.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(cmd, input=json.dumps(req), capture_output=True, text=True, timeout=timeout, env=env,
                         cwd=str(Path(draft_dir).parent))
    if res.returncode != 0:
        raise RuntimeError(f"{mode} side runner failed (rc {res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def compare(ours: dict, theirs: dict, max_new_tokens: int, block_size: int, truncating: bool = True) -> dict:
    """Per prompt and overall: outputs equal; acceptance lengths and drafted tokens equal in every compared cycle;
    tau of each side. z-lab's `dflash_generate` (`truncating`) drafts a SHORTER block once fewer than block_size
    tokens remain (its block attention is bidirectional, so those drafts legitimately differ): only the cycles
    before that are compared. Our engine and dflash.py always draft full blocks: every cycle's drafts are compared,
    and every acceptance length but the last (which each side counts after its own max_new_tokens cut)."""
    rows = []
    for a, b in zip(ours["results"], theirs["results"]):
        la, lb = a["acceptance_lengths"], b["acceptance_lengths"]
        da, db = a["drafts"], b["drafts"]
        if truncating:  # drafts: full blocks (>= block_size left); acceptance: not cut (> block_size left)
            n_acc = n_drafts = done = 0
            for x in lb:
                left = max_new_tokens - done
                n_drafts += left >= block_size
                n_acc += left > block_size
                done += x
        else:
            n_acc, n_drafts = max(0, len(lb) - 1), len(lb)
        rows.append({"output_equal": a["output"] == b["output"], "cycles": (len(la), len(lb)),
                     "compared_cycles": n_acc, "acceptance_equal": la[:n_acc] == lb[:n_acc],
                     "drafts_equal": len(da) >= n_drafts and len(db) >= n_drafts
                     and da[:n_drafts] == db[:n_drafts], "ours": la, "theirs": lb})
    tau = lambda side: (sum(sum(r["acceptance_lengths"]) for r in side["results"])  # noqa: E731
                        / max(1, sum(len(r["acceptance_lengths"]) for r in side["results"])))
    return {"prompts": len(rows), "cycles": sum(r["cycles"][0] for r in rows),
            "compared_cycles": sum(r["compared_cycles"] for r in rows),
            "outputs_equal": sum(r["output_equal"] for r in rows),
            "acceptance_equal": sum(r["acceptance_equal"] for r in rows),
            "drafts_equal": sum(r["drafts_equal"] for r in rows),
            "tau_ours": round(tau(ours), 3), "tau_theirs": round(tau(theirs), 3), "rows": rows}


def zlab_dflash2_spec(draft_dir: Path, seed: int = 7) -> dict:
    """What `side_runner.py` needs to build a random DFlash2 drafter with z-lab's class, shaped as `draft_dir`'s."""
    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    return {**{k: cfg["dflash_config"][k] for k in ("mask_token_id", "target_layer_ids", "block_size",
                                                     *DFLASH2_OPTIONS)},
            "num_hidden_layers": cfg["num_hidden_layers"], "seed": seed}


def strip_rope(src: Path, dst: Path) -> Path:
    """A copy of an export whose config.json says nothing of the rope base (what a 4.57 reader saw in our old
    export, which had only `rope_parameters`): every reader then falls back to 1e4."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        cfg.pop(key, None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/compat/roundtrip")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rope-theta", type=float, default=1e6)
    ap.add_argument("--target-steps", type=int, default=150)
    ap.add_argument("--draft-steps", type=int, default=400)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--zlab-python", default=str(ZLAB_PYTHON))
    ap.add_argument("--tf457-python", default=str(TF457_PYTHON))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--arch", choices=["dflash", "dflash2"], default="dflash",
                    help="the drafter trained by our pipeline (dflash2: `flashdraft train --arch dflash2`)")
    ap.add_argument("--selector-top-k", type=int, default=DFLASH2_OPTIONS["selector_top_k"],
                    help="the DFlash2 selector's candidates (0: the whole vocabulary, as `flashdraft train "
                         "--selector-top-k <vocab>`)")
    args = ap.parse_args(argv)
    if args.selector_top_k < 0 or args.arch != "dflash2" and args.selector_top_k != DFLASH2_OPTIONS["selector_top_k"]:
        ap.error(f"--selector-top-k {args.selector_top_k}: a DFlash2 option (--arch dflash2), 0 or more")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    options = {**DFLASH2_OPTIONS, "selector_top_k": args.selector_top_k or TINY_VOCAB}
    target_dir, draft_dir, prompts = build_pair(out, args.rope_theta, args.target_steps, args.draft_steps,
                                                arch=args.arch, dflash2_options=options)
    report = {"arch": args.arch, "rope_theta": args.rope_theta, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
              "prompts": len(prompts), "draft_config": json.loads((draft_dir / "config.json").read_text())}
    ours = run_ours(target_dir, draft_dir, prompts, args.max_new_tokens, args.dtype)
    report["ours"] = {k: v for k, v in ours.items() if k != "results"}
    table = []
    zpy = Path(args.zlab_python)
    if zpy.is_file():
        their_dir = out / f"zlab_saved_{args.arch}"
        if their_dir.exists():
            shutil.rmtree(their_dir)
        z = run_side(zpy, "zlab", target_dir, draft_dir, prompts, args.max_new_tokens, args.dtype, save_to=their_dir)
        report["zlab"] = {k: v for k, v in z.items() if k != "results"}
        report["ours_vs_zlab"] = compare(ours, z, args.max_new_tokens, z["block_size"])
        table.append(("our export -> z-lab from_pretrained + dflash_generate", report["ours_vs_zlab"], z))
        ours_on_theirs = run_ours(target_dir, their_dir, prompts, args.max_new_tokens, args.dtype)
        report["their_layout_in_ours"] = compare(ours_on_theirs, z, args.max_new_tokens, z["block_size"])
        report["their_saved_config"] = json.loads((their_dir / "config.json").read_text())
        table.append(("z-lab save_pretrained -> our from_pretrained + engine", report["their_layout_in_ours"], z))
        control = run_side(zpy, "zlab", target_dir, strip_rope(draft_dir, out / "no_rope_export"), prompts,
                           args.max_new_tokens, args.dtype)
        report["control_no_rope_base"] = compare(ours, control, args.max_new_tokens, control["block_size"])
        report["control_rope_theta_read"] = control["rope_theta_read"]
        table.append(("control: export without rope base -> z-lab", report["control_no_rope_base"], control))
        if args.arch == "dflash2":  # a checkpoint their class made (random, non-trivial convolutions and selector)
            made = run_side(zpy, "zlab", target_dir, out / "zlab_initialised", prompts, args.max_new_tokens,
                            args.dtype, init_dflash2=zlab_dflash2_spec(draft_dir))
            report["zlab_initialised_in_ours"] = compare(run_ours(target_dir, out / "zlab_initialised", prompts,
                                                                  args.max_new_tokens, args.dtype),
                                                         made, args.max_new_tokens, made["block_size"])
            table.append(("z-lab-initialised DFlash2 (their layout) -> ours vs their dflash_generate",
                          report["zlab_initialised_in_ours"], made))
    else:
        report["zlab"] = f"skipped: no z-lab side venv at {zpy} (bash scripts/speed/setup_zlab_env.sh)"
    tpy = Path(args.tf457_python)
    if args.arch == "dflash2":
        report["tf457"] = "skipped: the remote code (dflash.py) runs DFlash-1 drafters only"
    elif tpy.is_file():
        r = run_side(tpy, "remote", target_dir, draft_dir, prompts, args.max_new_tokens, args.dtype,
                     tokenizer=SHIPPED_TARGET)
        report["tf457"] = {k: v for k, v in r.items() if k != "results"}
        report["ours_vs_tf457_remote_code"] = compare(ours, r, args.max_new_tokens, r["block_size"], truncating=False)
        table.append(("our export -> transformers 4.57 AutoModel(trust_remote_code) + dflash.py",
                      report["ours_vs_tf457_remote_code"], r))
    else:
        report["tf457"] = f"skipped: no transformers-4.57 side venv at {tpy} (bash scripts/compat/setup_tf457_env.sh)"
    print(f"{args.arch} drafter trained for a Qwen3 target with rope base {args.rope_theta:g}; {len(prompts)} held-out prompts, "
          f"{args.max_new_tokens} new tokens, greedy, {args.dtype}; ours read rope base {ours['rope_theta_read']:g}")
    print(f"| reader | rope base read | tau ours | tau theirs | cycles compared | acceptance equal | drafts equal "
          f"| outputs equal |\n|---|---|---|---|---|---|---|---|")
    for name, c, side in table:
        print(f"| {name} | {side.get('rope_theta_read') or 0:g} | {c['tau_ours']} | {c['tau_theirs']} | "
              f"{c['compared_cycles']} | {c['acceptance_equal']}/{c['prompts']} prompts | "
              f"{c['drafts_equal']}/{c['prompts']} | {c['outputs_equal']}/{c['prompts']} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
