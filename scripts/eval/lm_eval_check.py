"""An evaluation harness against `flashdraft serve`: EleutherAI's lm-evaluation-harness scores the served shipped pair
(DFlash drafting; the harness's `local-completions` model: batched token-id prompts, echo + logprobs for
log-likelihoods, greedy generation) and the same target through transformers (its `hf` model), on two tasks built
here from the held-out prompts; their per-sample results must agree.

    bash scripts/eval/setup_lm_eval_env.sh        # once: the harness in a side venv
    python scripts/eval/lm_eval_check.py [--num 32] [--batch-size 8] [--out runs/lm_eval_check]

Tasks (written to OUT/tasks): `flashdraft_code_mc`, each prompt's four candidate continuations (the target's own
greedy one and three other prompts'; the harness's log-likelihood requests, accuracy), and `flashdraft_code_gen`,
greedy generation until a blank line (generate_until requests, exact match against the target's own continuation).
Prints both sides' metrics, the largest difference between their log-likelihoods and how many multiple-choice
answers and generations differ; exit 1 if any does.

What this script does not know about: other tasks (the harness's registry needs the hub), sampling.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flashdraft.bench.datasets import load_prompts
from flashdraft.bench.server import local_server
from flashdraft.loading import DEFAULT_TARGET

MODEL_NAME = "flashdraft-default"
TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "{{{{context}}}}"
target_delimiter: ""
{body}"""
MC_BODY = """output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
metric_list:
  - metric: acc
"""
GEN_BODY = """output_type: generate_until
doc_to_target: "{{{{continuation}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: {max_tokens}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@torch.inference_mode()
def write_tasks(out: Path, num: int, max_tokens: int) -> None:
    """The two tasks' data (JSON lines) and YAML under out/: continuations are the target's own greedy ones."""
    tok = AutoTokenizer.from_pretrained(DEFAULT_TARGET)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET, dtype=torch.float32).eval()
    contexts = [p.text for p in load_prompts("default", num)]
    continuations = []
    for text in contexts:
        ids = tok(text, return_tensors="pt").input_ids
        new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tok.eos_token_id)[0, ids.shape[1]:]
        continuations.append(tok.decode(new, skip_special_tokens=True))
    rng = random.Random(0)
    mc, gen = [], []
    for i, (context, own) in enumerate(zip(contexts, continuations)):
        others = rng.sample([c for j, c in enumerate(continuations) if j != i], 3)
        choices = [own] + others
        rng.shuffle(choices)
        mc.append({"context": context, "choices": choices, "label": choices.index(own)})
        gen.append({"context": context, "continuation": own.split("\n\n")[0]})
    out.mkdir(parents=True, exist_ok=True)
    for name, rows, body in (("flashdraft_code_mc", mc, MC_BODY),
                             ("flashdraft_code_gen", gen, GEN_BODY.format(max_tokens=max_tokens))):
        data = out / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / f"{name}.yaml").write_text(TASK_YAML.format(name=name, data=data.resolve(), body=body))


def run_harness(python: str, model: str, model_args: str, tasks: Path, out: Path, batch_size: int) -> dict:
    """One `lm_eval` run; returns {task: (metrics, [sample records in doc order])}."""
    cmd = [python, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks",
           "flashdraft_code_mc,flashdraft_code_gen", "--include_path", str(tasks), "--batch_size", str(batch_size),
           "--log_samples", "--output_path", str(out), "--seed", "0"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(out.with_suffix(".log"), "w") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode:
            raise SystemExit(f"error: lm_eval ({model}) failed: see {out.with_suffix('.log')}")
    results = json.loads(max(out.rglob("results_*.json"), key=os.path.getmtime).read_text())["results"]
    report = {}
    for task in ("flashdraft_code_mc", "flashdraft_code_gen"):
        samples = max(out.rglob(f"samples_{task}_*.jsonl"), key=os.path.getmtime).read_text().splitlines()
        report[task] = (results[task], sorted((json.loads(s) for s in samples), key=lambda s: s["doc_id"]))
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num", type=int, default=32, help="held-out prompts per task")
    p.add_argument("--max-tokens", type=int, default=24, help="continuation length (both tasks)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per request the harness sends the server")
    p.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    p.add_argument("--lm-eval-python", default=str(Path.home() / ".cache/flashdraft/venv-lmeval/bin/python"),
                   help="the side venv's python (scripts/eval/setup_lm_eval_env.sh)")
    p.add_argument("--out", type=Path, default=Path("runs/lm_eval_check"))
    args = p.parse_args(argv)
    if not Path(args.lm_eval_python).is_file():
        raise SystemExit(f"error: no lm-eval side venv at {args.lm_eval_python}; run scripts/eval/setup_lm_eval_env.sh")
    write_tasks(args.out / "tasks", args.num, args.max_tokens)
    reports = {}
    with open(args.out / "server.log", "w") as log, local_server(
            ["--threads", str(args.threads), "--served-model-name", MODEL_NAME, "--log-level", "warning"],
            log) as (url, _):
        reports["served"] = run_harness(
            args.lm_eval_python, "local-completions", f"model={MODEL_NAME},base_url={url}/v1/completions,"
            f"tokenizer={DEFAULT_TARGET},tokenized_requests=True,num_concurrent=1,max_retries=1",
            args.out / "tasks", args.out / "served", args.batch_size)
    reports["transformers"] = run_harness(args.lm_eval_python, "hf", f"pretrained={DEFAULT_TARGET},dtype=float32",
                                          args.out / "tasks", args.out / "transformers", 1)
    served, hf = reports["served"], reports["transformers"]
    mc_s, mc_h = served["flashdraft_code_mc"][1], hf["flashdraft_code_mc"][1]
    gaps = [abs(float(a[0]) - float(b[0]))  # each choice's (log-likelihood, is greedy), as the harness logs them
            for s, h in zip(mc_s, mc_h) for a, b in zip(s["filtered_resps"], h["filtered_resps"])]
    answers = sum(s["acc"] != h["acc"] for s, h in zip(mc_s, mc_h))
    gen_s, gen_h = served["flashdraft_code_gen"][1], hf["flashdraft_code_gen"][1]
    generations = sum(s["filtered_resps"] != h["filtered_resps"] for s, h in zip(gen_s, gen_h))
    print("| side | mc acc | gen exact_match |")
    print("|---|---|---|")
    for side, report in reports.items():
        print(f"| {side} | {report['flashdraft_code_mc'][0]['acc,none']:.4f} | "
              f"{report['flashdraft_code_gen'][0]['exact_match,none']:.4f} |")
    print(f"multiple choice: {len(mc_s)} questions, {len(gaps)} log-likelihoods, largest difference {max(gaps):.2e}, "
          f"{answers} answers differ")
    print(f"generation: {generations} of {len(gen_s)} generations differ")
    return 1 if answers or generations else 0


if __name__ == "__main__":
    sys.exit(main())
