"""Side by side with the peer itself: z-lab's own `dflash` package (PyPI `dflash` 0.1.0) against our engine.

    bash scripts/speed/setup_zlab_env.sh                  # once: the side venv with dflash[local]==0.1.0
    python scripts/speed/bench_zlab.py --threads 2 --json runs/speed/bench_zlab.json

Their package pins transformers==5.15.0 (`dflash[local]`) and datasets==5.0.1, ours needs transformers>=5.23, so it
cannot live in our venv: it runs in a side venv (default ~/.cache/flashdraft/venv-zlab, or --zlab-python /
$FLASHDRAFT_ZLAB_PYTHON) as a persistent subprocess (`flashdraft/bench/zlab_runner.py`, which imports nothing of ours) that
loads the same target and drafter directories with their own loader and decodes with their `dflash_generate`.

Methods, on the same checkpoint and prompts (default: the shipped pair, 8 held-out prompts, 128 new tokens,
greedy, batch 1):
- z-lab dflash_generate (their package, block 16; target and drafter in --zlab-dtype, fp32 by default: their
  loop feeds the target's fp32 embeddings and features to the drafter and its hidden states to the target's
  lm_head, so it cannot mix dtypes), and their block_size=1 path (their own plain-decoding baseline);
- our engine eager and compiled (CPU default: fp32 target, bf16 drafter) and compiled with the drafter in fp32
  (like for like with theirs);
- plain decoding through our engine (block size 1, eager);
- transformers' own greedy `generate` on the target (our transformers), which is also the reference output.
Rounds (--rounds) interleave the methods prompt by prompt, the order reversed every other prompt and round, so
that the machine's drift (and other jobs' load) hits all methods alike; only one process computes at a time (the
other waits on a pipe). Reports tokens/s per method (prefill included; best of rounds, i.e. each prompt's
fastest round, since other jobs only ever add time; and all rounds together), tau (tokens committed per draft
cycle, bonus included, counted alike for both sides), ratios to their package, whether each output equals
transformers' greedy `generate`, and which GEMM kernels each side runs (a short untimed probe with MKL_VERBOSE /
ONEDNN_VERBOSE on one prompt). Writes --json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from flashdraft.bench.zlab import RUNNER, ZlabRunner, zlab_python
PAUSE_S = 0.3  # between methods: lets the other process's OpenMP threads stop spinning


def kernel_summary(log: str) -> dict:
    """Counts of MKL GEMM calls and oneDNN primitive executions in an MKL_VERBOSE / ONEDNN_VERBOSE log."""
    mkl = collections.Counter()
    shapes = collections.Counter()
    onednn = collections.Counter()
    for line in log.splitlines():
        m = re.match(r"MKL_VERBOSE (\w+)\(([^)]*)\)", line)
        if m:
            mkl[m.group(1)] += 1
            a = m.group(2).split(",")
            if "GEMM" in m.group(1) and len(a) > 4:
                shapes[f"{m.group(1)} m{a[2]} n{a[3]} k{a[4]}"] += 1
            continue
        if line.startswith("onednn_verbose") and ",primitive,exec," in line:
            f = line.split(",")
            i = f.index("exec")
            onednn[f"{f[i + 2]}:{f[i + 3]}"] += 1  # kind:implementation
    return {"mkl_calls": dict(mkl), "onednn_primitives": dict(onednn),
            "mkl_top_shapes": dict(shapes.most_common(6))}


def probe_ours(args) -> int:
    """Child process of the kernel probe: one prompt through our engine (eager, default packing)."""
    import torch

    from flashdraft.demo import load_heldout_prompts
    from flashdraft.engine import SamplingParams, SpecEngine
    from flashdraft.loading import load_pair

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tok, drafter = load_pair(args.target, args.draft, "cpu", None, None)
    ids = tok(load_heldout_prompts(1)[0], add_special_tokens=False)["input_ids"]
    engine = SpecEngine(target, drafter, tok, draft_policy="fixed")  # every cycle drafts: their loop's kernels
    _mark(PROBE_MARK)  # count the decode only, not the loading and packing
    engine.generate([ids], SamplingParams(max_new_tokens=32, stop_token_ids=()))
    return 0


PROBE_MARK = "=== PROBE START ==="


def _mark(text: str) -> None:
    """Write `text` to fd 1 in order with what C code (MKL, oneDNN) printed before it."""
    import ctypes

    sys.stdout.flush()
    ctypes.CDLL(None).fflush(None)
    os.write(1, (text + "\n").encode())


def run_probe(cmd, stdin_text=None) -> dict:
    env = dict(os.environ, MKL_VERBOSE="1", ONEDNN_VERBOSE="1")
    res = subprocess.run(cmd, input=stdin_text, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         timeout=600)
    log = res.stdout
    if PROBE_MARK in log:  # ours: the decode only
        log = log.split(PROBE_MARK, 1)[1]
    return kernel_summary(log)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompts", help="JSONL with a 'prompt' field (default: the default pair's held-out prompts)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--zlab-python", default=None,
                    help="default: $FLASHDRAFT_ZLAB_PYTHON, else ~/.cache/flashdraft/venv-zlab (`zlab.zlab_python`)")
    ap.add_argument("--zlab-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--no-compile", action="store_true", help="skip our compiled methods")
    ap.add_argument("--no-kernel-probe", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--probe-ours", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    from flashdraft.loading import default_pair_paths

    if args.target is None:
        t, d = default_pair_paths()
        args.target, args.draft = str(t), str(args.draft or d)
    if args.draft is None:
        ap.error("--draft is required with --target")
    if args.probe_ours:
        return probe_ours(args)
    python = zlab_python(args.zlab_python)
    if python is None:
        print(f"no side venv python at {args.zlab_python or 'the default place'}: run scripts/speed/setup_zlab_env.sh "
              "(or pass --zlab-python)", file=sys.stderr)
        return 2
    args.zlab_python = str(python)

    import torch

    from flashdraft.engine import SamplingParams, SpecEngine
    from flashdraft.loading import load_pair

    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()
    target, tok, drafter = load_pair(args.target, args.draft, "cpu", None, None)
    drafter32 = None
    if not args.no_compile and drafter.dtype != torch.float32:
        _, _, drafter32 = load_pair(args.target, args.draft, "cpu", None, "float32")
    if args.prompts:
        texts = [json.loads(line)["prompt"] for line in open(args.prompts) if line.strip()]
    else:
        from flashdraft.demo import load_heldout_prompts

        texts = load_heldout_prompts()
    texts = texts[: args.num_prompts]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    eos = target.generation_config.eos_token_id
    eos = eos if eos is not None else tok.eos_token_id
    stop = (eos,) if isinstance(eos, int) else tuple(eos or ())
    params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=stop)

    zlab = ZlabRunner(args.zlab_python, args.target, args.draft, args.threads, args.zlab_dtype)
    print(f"z-lab side: dflash {zlab.info['dflash_version']} ({zlab.info['dflash_file']}), transformers "
          f"{zlab.info['transformers']}, torch {zlab.info['torch']}, {zlab.info['threads']} threads, "
          f"{zlab.info['draft_module']}.{zlab.info['draft_class']} in {zlab.info['draft_dtype']}", flush=True)

    engines = {"ours (eager)": SpecEngine(target, drafter, tok),
               "plain decoding (our engine)": SpecEngine(target, None, tok)}
    if not args.no_compile:
        engines["ours (compiled)"] = SpecEngine(target, drafter, tok, compile=True)
        if drafter32 is not None:
            engines["ours (compiled, fp32 drafter)"] = SpecEngine(target, drafter32, tok, compile=True)
    pack = {name: getattr(e, "pack_weights", None) for name, e in engines.items()}

    def engine_method(name):
        def run(batch):
            outs, secs, accs = [], [], []
            for ids in batch:
                t0 = time.perf_counter()
                r = engines[name].generate([ids], params)[0]
                secs.append(time.perf_counter() - t0)
                outs.append(list(r.token_ids))
                accs.append(list(r.stats.acceptance_lengths) if engines[name].block_size > 1 else [])
            return outs, secs, accs
        return run

    def hf_generate(batch):
        outs, secs = [], []
        for ids in batch:
            t0 = time.perf_counter()
            out = target.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False,
                                  eos_token_id=list(stop) or None, pad_token_id=stop[0] if stop else 0)
            secs.append(time.perf_counter() - t0)
            outs.append(out[0, len(ids):].tolist())
        return outs, secs, [[] for _ in batch]

    def zlab_method(block_size):
        def run(batch):
            r = zlab.request(cmd="round", prompts=batch, max_new_tokens=args.max_new_tokens, block_size=block_size)
            return r["outputs"], r["seconds"], r["acceptance_lengths"] if block_size != 1 else [[] for _ in batch]
        return run

    methods = {"z-lab dflash_generate": zlab_method(None),
               "z-lab dflash_generate (block 1 = their plain)": zlab_method(1)}
    methods.update({name: engine_method(name) for name in engines})
    methods["transformers generate"] = hf_generate

    print("warm-up (compiles our compiled steps) ...", flush=True)
    for fn in methods.values():
        fn(prompts[:2])
    their_hf = zlab.request(cmd="generate_hf", prompts=prompts, max_new_tokens=args.max_new_tokens)["outputs"]

    names = list(methods)
    side = {m: m.startswith("z-lab") for m in names}  # which process computes
    tokens = {m: 0 for m in names}
    seconds = {m: 0.0 for m in names}
    per_round = {m: [] for m in names}
    acceptance = {m: [] for m in names}  # the engine's own per-cycle acceptance lengths
    cycles = {m: 0 for m in names}  # draft cycles (target verify passes after the prefill)
    outputs = {m: [] for m in names}
    times = {m: [[] for _ in prompts] for m in names}  # seconds per prompt, one per round
    last_side = None
    for r in range(args.rounds):
        n_round = {m: 0 for m in names}
        s_round = {m: 0.0 for m in names}
        for i, ids in enumerate(prompts):  # every method on each prompt in turn; the order flips every prompt
            for m in (names if (r + i) % 2 == 0 else names[::-1]):
                if side[m] != last_side:
                    time.sleep(PAUSE_S)
                    last_side = side[m]
                (out,), (sec,), (acc,) = methods[m]([ids])
                n_round[m] += len(out)
                s_round[m] += sec
                times[m][i].append(sec)
                if r == 0:
                    outputs[m].append(out)
                    acceptance[m].extend(acc)
                    cycles[m] += len(acc)
                elif out != outputs[m][i]:
                    print(f"WARNING: {m}: prompt {i}: output changed between rounds", file=sys.stderr)
        for m in names:
            tokens[m] += n_round[m]
            seconds[m] += s_round[m]
            per_round[m].append(n_round[m] / s_round[m])
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{m} {per_round[m][-1]:.0f}" for m in names), flush=True)
    zlab.close()
    load_after = os.getloadavg()

    kernels = {}
    if not args.no_kernel_probe:
        print("kernel probe (MKL_VERBOSE / ONEDNN_VERBOSE, one prompt, 32 tokens, untimed) ...", flush=True)
        threads = ["--threads", str(args.threads)] if args.threads else []
        kernels["ours (eager, default packing)"] = run_probe(
            [sys.executable, str(Path(__file__).resolve()), "--probe-ours", "--target", args.target, "--draft",
             args.draft, *threads])
        req = json.dumps({"cmd": "round", "prompts": prompts[:1], "max_new_tokens": 32, "block_size": None})
        kernels["z-lab dflash_generate"] = run_probe(
            [args.zlab_python, str(RUNNER), "--target", args.target, "--draft", args.draft, "--dtype",
             args.zlab_dtype, *threads], stdin_text=req + "\n")

    reference = outputs["transformers generate"]  # the target's own greedy output (round 1)
    # best of rounds: each prompt's fastest round (other jobs' load only ever adds time), the primary figure on a
    # shared machine; all rounds together as well
    tps_all = {m: tokens[m] / seconds[m] for m in names}
    tps = {m: sum(len(o) for o in outputs[m]) / sum(min(t) for t in times[m]) for m in names}
    # tau: tokens committed per draft cycle, counted the same way for both sides (every output token but the
    # prefill's, over the cycles). The engines' own means differ in the last cycle of a request: ours counts what
    # the verifier accepted, theirs clips it to the token budget (both in the JSON).
    tau = {m: ((sum(len(o) for o in outputs[m]) - len(outputs[m])) / cycles[m] if cycles[m] else None)
           for m in names}
    tau_reported = {m: (sum(acceptance[m]) / len(acceptance[m]) if acceptance[m] else None) for m in names}
    equal = {m: sum(a == b for a, b in zip(outputs[m], reference)) for m in names}
    peer = tps["z-lab dflash_generate"]
    n_p = len(prompts)
    print(f"\n{n_p} prompts, {args.max_new_tokens} new tokens, greedy, batch 1, {args.rounds} alternating rounds, "
          f"{torch.get_num_threads()} threads; target {target.dtype}; our drafter {drafter.dtype} (z-lab's "
          f"{zlab.info['draft_dtype']}); load average before {load[0]:.2f} / after {load_after[0]:.2f}\n")
    print("| method | tokens/s (best of rounds) | vs z-lab dflash | tokens/s (all rounds) | vs z-lab | per round | "
          "vs z-lab per round | tau | tau (engine's own) | outputs equal transformers generate |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    zr = per_round["z-lab dflash_generate"]
    for m in names:
        rounds = " / ".join(f"{x:.0f}" for x in per_round[m])
        ratios = " / ".join(f"{x / z:.2f}" for x, z in zip(per_round[m], zr))
        t = f"{tau[m]:.2f}" if tau[m] is not None else "-"
        t_own = f"{tau_reported[m]:.2f}" if tau_reported[m] is not None else "-"
        print(f"| {m} | {tps[m]:.1f} | {tps[m] / peer:.2f}x | {tps_all[m]:.1f} | "
              f"{tps_all[m] / tps_all['z-lab dflash_generate']:.2f}x | {rounds} | {ratios} | {t} | {t_own} | "
              f"{equal[m]}/{n_p} |")
    their_equal = sum(a == b for a, b in zip(their_hf, reference))
    print(f"\ntransformers {zlab.info['transformers']} greedy generate (their venv) equals transformers "
          f"{__import__('transformers').__version__} greedy generate (ours): {their_equal}/{n_p}")
    print(f"our engines pack_weights: {pack}")
    for side, k in kernels.items():
        print(f"kernels, {side}: MKL {k['mkl_calls'] or 'none'}; oneDNN {k['onednn_primitives'] or 'none'}; "
              f"most frequent MKL GEMMs {k['mkl_top_shapes'] or 'none'}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "tokens_per_second": tps, "tokens_per_second_all_rounds": tps_all,
            "tokens_per_second_per_round": per_round, "seconds_per_prompt": times, "vs_zlab": {m: tps[m] / peer
                                                                                              for m in names},
            "tau": tau, "tau_engine_reported": tau_reported, "equal_to_transformers_generate": equal, "num_prompts": n_p,
            "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "threads": torch.get_num_threads(),
            "target_dtype": str(target.dtype), "drafter_dtype": str(drafter.dtype), "zlab": zlab.info,
            "zlab_transformers_generate_equal_ours": their_equal, "pack_weights": pack, "kernels": kernels,
            "loadavg_before": load, "loadavg_after": load_after}, indent=2, default=str))
    return 0 if all(v == n_p for v in equal.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
