"""Trains the shipped default target: a small Qwen3-architecture code LM on the Python stdlib.

Reads the corpus (``scripts/default_pair/corpus.py``) and the tokenizer
(``scripts/default_pair/tokenizer.py``, saved in the output directory), trains a
``Qwen3ForCausalLM`` with tied embeddings on packed sequences (eos before every
file), evaluates loss / perplexity on the held-out split, and saves the model in
bfloat16 (safetensors) next to the tokenizer, with a ``generation_config.json``,
``train_stats.json`` and a generated ``README.md`` model card.

Run (from the repository root)::

    python scripts/default_pair/train_target.py --minutes 35

The learning-rate schedule (linear warmup, cosine to ``--min-lr-ratio``) follows
training progress = max(step / max_steps, elapsed / budget), so the run ends on time
even on a shared machine. For a bit-reproducible run give a fixed step count and no
time budget: ``--minutes 0 --max-steps N``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from scripts.default_pair.corpus import DEFAULT_OUT as CORPUS_DIR  # noqa: E402
from scripts.default_pair.corpus import heldout_prompts, load_corpus  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "flashdraft" / "assets" / "default_pair" / "target"


# --------------------------------------------------------------------------- data


def tokenize_split(tok_dir: Path, split: str) -> np.ndarray:
    """One packed stream: [eos] file_0 [eos] file_1 ... (eos before every file)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.encode_special_tokens = True  # special-token strings in text stay plain bytes
    eos = tok.token_to_id("<|endoftext|>")
    docs = load_corpus(split)
    encs = tok.encode_batch([d["text"] for d in docs], add_special_tokens=False)
    out = []
    for e in encs:
        out.append(eos)
        out.extend(e.ids)
    return np.asarray(out, dtype=np.int64)


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping (seq_len + 1)-token windows over the stream (last partial dropped).

    All of them, or ``max_windows`` of them evenly spaced over the whole stream.
    """
    n = (len(stream) - 1) // seq_len
    k = np.arange(n)
    if max_windows is not None and max_windows < n:
        k = np.linspace(0, n - 1, max_windows).round().astype(np.int64)
    idx = k[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(stream[idx])


def final_eval(model, tok_dir: Path, seq_len: int, batch_size: int) -> dict:
    """Loss on the whole held-out split and on as many train windows, evenly spaced over the train split."""
    heldout_w = eval_windows(tokenize_split(tok_dir, "heldout"), seq_len)
    train_w = eval_windows(tokenize_split(tok_dir, "train"), seq_len, max_windows=len(heldout_w))
    heldout_loss = evaluate(model, heldout_w, batch_size, False)
    train_loss = evaluate(model, train_w, batch_size, False)
    return {
        "heldout_loss": heldout_loss, "heldout_ppl": math.exp(heldout_loss),
        "heldout_tokens": int(heldout_w[:, 1:].numel()),
        "train_loss": train_loss, "train_ppl": math.exp(train_loss), "train_tokens": int(train_w[:, 1:].numel()),
    }


class Batches:
    """Infinite packed-batch iterator: each epoch a random offset and a shuffled window order."""

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, seed: int):
        self.stream, self.L, self.B = stream, seq_len, batch_size
        self.rng = np.random.default_rng(seed)
        self.epoch = 0
        self.tokens_per_epoch = len(stream)
        self._new_epoch()

    def _new_epoch(self):
        off = int(self.rng.integers(0, self.L))
        n = (len(self.stream) - off - 1) // self.L
        self.starts = off + self.rng.permutation(n) * self.L
        self.pos = 0

    def __next__(self) -> torch.Tensor:
        if self.pos + self.B > len(self.starts):
            self.epoch += 1
            self._new_epoch()
        s = self.starts[self.pos : self.pos + self.B]
        self.pos += self.B
        idx = s[:, None] + np.arange(self.L + 1)[None, :]
        return torch.from_numpy(self.stream[idx])


# --------------------------------------------------------------------------- model


def build_model(args, vocab_size: int, eos_id: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate,
        max_position_embeddings=args.max_pos,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        hidden_act="silu",
        initializer_range=0.02,
        use_cache=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg)
    return model


def lm_loss(model, batch: torch.Tensor, autocast: bool) -> torch.Tensor:
    x, y = batch[:, :-1], batch[:, 1:]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch_size: int, autocast: bool) -> float:
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(windows), batch_size):
        b = windows[i : i + batch_size]
        tot += lm_loss(model, b, autocast).item() * b[:, 1:].numel()
        n += b[:, 1:].numel()
    model.train()
    return tot / max(n, 1)


def lr_at(step: int, progress: float, args) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    p = min(max(progress, 0.0), 1.0)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


@torch.no_grad()
def greedy_sample(model, tokenizer, index: int = 0, max_new_tokens: int = 96) -> dict:
    """Greedy continuation of the ``index``-th held-out prompt."""
    rec = heldout_prompts(index + 1, with_meta=True)[index]
    ids = tokenizer(rec["prompt"], return_tensors="pt").input_ids
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    completion = tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    return {"path": rec["path"], "lineno": rec["lineno"], "prompt": rec["prompt"], "completion": completion,
            "max_new_tokens": max_new_tokens}


def refresh_card(out: Path, threads: int = 2, batch_size: int = 32) -> None:
    """Re-evaluates the saved weights, redoes the greedy sample, rewrites train_stats.json and README.md."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    stats = json.loads((out / "train_stats.json").read_text())
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    stats["eval"] = final_eval(model, out, stats["training"]["seq_len"], batch_size)
    print(f"[train] eval: {json.dumps(stats['eval'])}")
    stats["sample"] = greedy_sample(model, tok)
    (out / "train_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    write_card(out, stats)
    print(f"[train] card refreshed: {out / 'README.md'}")


# --------------------------------------------------------------------------- card


def _clean_tokenizer_config(out: Path) -> None:
    """Drops load-time keys that re-saving a loaded tokenizer writes (``is_local`` etc.)."""
    p = out / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    for k in ("is_local", "local_files_only", "_commit_hash"):
        cfg.pop(k, None)
    p.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, text=True).strip()
    except Exception:
        return "unknown"


def write_card(out: Path, stats: dict) -> None:
    m, c, t, tr = stats["corpus"], stats["config"], stats["tokenizer"], stats["training"]
    sample = stats.get("sample", {})
    card = f"""# flashdraft default target: `stdlib-qwen3-{stats['params_m']:.1f}m`

A tiny **code-completion** causal LM (Qwen3 architecture) trained from scratch on the
Python standard library. It is the *target* half of the default pair shipped with
`flashdraft`: small enough to run on a CPU in tests and demos, trained enough to produce
plausible Python so that a drafter has something real to predict.
It is not a useful code assistant.

## Data

* Source: the `*.py` files of the CPython **{m['python_version']}** standard library
  (`sysconfig.get_paths()["stdlib"]`), PSF License.
* Excluded: any path component named `test`, `tests`, `idle_test` (`idlelib/idle_test`,
  `lib2to3/tests`, ...), `site-packages`, `__pycache__`; files over 200 KB
  ({', '.join(m['skipped_too_large']) or 'none'}); empty files.
* Split by path hash: `int(sha1(relpath).hexdigest(), 16) % 100 < 5` -> held-out.
* Files: **{m['files']['train']} train / {m['files']['heldout']} held-out**
  ({m['bytes']['train']:,} / {m['bytes']['heldout']:,} bytes).
* Corpus checksum (sha256, see `scripts/default_pair/corpus.py::corpus_sha256`):
  `{m['sha256']}`
* Tokens (this tokenizer): {t['train_tokens']:,} train / {t['heldout_tokens']:,} held-out
  ({t['bytes_per_token']:.2f} bytes per token on held-out).

## Tokenizer

Byte-level BPE (`tokenizers`), vocab **{t['vocab_size']}**, trained on the train split.
Special tokens: `<|endoftext|>` = id {t['eos_id']} (eos, also bos and pad) and
`<|mask|>` = id {t['mask_id']} (dedicated DFlash mask token; `tokenizer.mask_token_id`).
Saved with `split_special_tokens=True`, so these strings inside ordinary text are encoded
as plain bytes: the special ids never come from encoding text. No bos is prepended.
**No chat template**: this is a plain code-completion model; feed it raw Python.

## Architecture

`Qwen3ForCausalLM`, tied input/output embeddings, weights stored in **bfloat16**
(`model.safetensors`).

| | |
|---|---|
| parameters | **{stats['params']:,}** ({stats['params_non_embedding']:,} without the embedding) |
| vocab | {c['vocab_size']} |
| hidden size | {c['hidden_size']} |
| layers | {c['num_hidden_layers']} |
| attention heads / kv heads / head dim | {c['num_attention_heads']} / {c['num_key_value_heads']} / {c['head_dim']} |
| MLP intermediate | {c['intermediate_size']} |
| max positions | {c['max_position_embeddings']} (trained on {tr['seq_len']}-token windows) |
| rope theta | {c['rope_theta']} |

## Training

| | |
|---|---|
| objective | next-token cross-entropy on packed {tr['seq_len']}-token windows, `<|endoftext|>` before every file |
| optimizer | AdamW (betas {tr['betas']}, weight decay {tr['weight_decay']}), peak lr {tr['lr']}, {tr['warmup_steps']} warmup steps, cosine to {tr['min_lr_ratio']}x, grad clip 1.0 |
| batch | {tr['batch_size']} x {tr['seq_len']} = {tr['batch_size'] * tr['seq_len']:,} tokens per step |
| precision | fp32 master weights{', bf16 autocast' if tr['autocast_bf16'] else ''}; saved in bf16 |
| seed | {tr['seed']} |
| steps | **{tr['steps']:,}** |
| tokens seen | **{tr['tokens_seen']:,}** ({tr['epochs']:.2f} epochs of the train split) |
| throughput | {tr['tokens_per_s']:,.0f} tokens/s |
| wall time (training loop) | {tr['train_wall_s'] / 60:.1f} min (total script {tr['total_wall_s'] / 60:.1f} min) |
| machine | {stats['machine']} |

## Results

| | loss (nats/token) | perplexity |
|---|---|---|
| final train loss (mean of last {tr['final_train_loss_window']} steps) | {tr['final_train_loss']:.4f} | {math.exp(tr['final_train_loss']):.2f} |
| train split, saved bf16 weights ({stats['eval']['train_tokens']:,} tokens, evenly spaced windows) | {stats['eval']['train_loss']:.4f} | {math.exp(stats['eval']['train_loss']):.2f} |
| **held-out split**, saved bf16 weights ({stats['eval']['heldout_tokens']:,} tokens) | **{stats['eval']['heldout_loss']:.4f}** | **{math.exp(stats['eval']['heldout_loss']):.2f}** |

Greedy continuation of a held-out prompt (`{sample.get('path', '')}`, line {sample.get('lineno', '')}), prompt then output:

```python
{sample.get('prompt', '')}
```

```python
{sample.get('completion', '')}
```

(The prompt ends right after its last character, without a newline; see "Prompts" below.)

## Use

```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d = "flashdraft/assets/default_pair/target"
tok = AutoTokenizer.from_pretrained(d)
model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
ids = tok("def fibonacci(n):", return_tensors="pt").input_ids  # no trailing newline, see Prompts
print(tok.decode(model.generate(ids, max_new_tokens=64, do_sample=False)[0]))
```

## Prompts

Deterministic prompts for evaluation and drafter training (starts of functions and classes:
a few lines of context, the `def`/`class` header and the docstring's first line):

```python
from scripts.default_pair.corpus import heldout_prompts, train_prompts  # run from the repo root
heldout_prompts(n=64)    # list[str] from held-out files
train_prompts(n=1024)    # list[str] from train files
```

Prompts end without a trailing newline. The byte-level BPE merges a newline with the
indentation that follows it (`"\\n        "` is one token), so a prompt that ends in a bare
`"\\n"` makes the model expect column-0 code next. End prompts mid-line, or right after the
`:` of a header, to get an indented body.

## Rebuild

From the repository root, with the same Python ({m['python_version']}) so that the corpus checksum matches:

```bash
bash scripts/default_pair/build_target.sh --force          # all three steps
# or step by step:
python scripts/default_pair/corpus.py --force
python scripts/default_pair/tokenizer.py --force
python scripts/default_pair/train_target.py {stats['argv']}
```

The learning-rate schedule of a timed run follows wall-clock progress, so the step count and
the exact weights depend on the machine and its load. For a run that is deterministic on a
given machine and library versions, fix the steps instead:
`--minutes 0 --max-steps {tr['steps']}` (same data order and seed, cosine over steps; close to,
not identical with, the weights shipped here).
Trained on top of git commit `{stats['git_commit'][:12]}` with torch {stats['versions']['torch']}, transformers {stats['versions']['transformers']}, tokenizers {stats['versions']['tokenizers']}.
"""
    (out / "README.md").write_text(card)


# --------------------------------------------------------------------------- main


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Train the default-pair target model")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--max-pos", type=int, default=2048)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--minutes", type=float, default=35.0, help="training wall-clock budget; 0 = none")
    ap.add_argument("--max-steps", type=int, default=0, help="0 = no step limit (needs --minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--autocast-bf16", action=argparse.BooleanOptionalAction, default=True,
                    help="bf16 autocast for the forward (fp32 master weights); ~3x faster matmuls on AVX512-BF16 CPUs")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="torch.compile the training forward (compiled before the clock starts)")
    ap.add_argument("--eval-every", type=int, default=200, help="steps between quick held-out evals; 0 = off")
    ap.add_argument("--eval-batch-size", type=int, default=32)
    ap.add_argument("--machine-note", default="", help="free text about the machine, copied into the card")
    ap.add_argument("--no-save", action="store_true", help="benchmark only: do not save anything")
    ap.add_argument("--force", action="store_true", help="retrain even if model.safetensors exists")
    ap.add_argument("--card-only", action="store_true",
                    help="no training: re-evaluate the saved model, redo the greedy sample, rewrite README.md")
    args = ap.parse_args(argv)
    if args.card_only:
        refresh_card(args.out, args.threads, args.eval_batch_size)
        return
    if args.minutes <= 0 and args.max_steps <= 0:
        ap.error("give --minutes and/or --max-steps")

    out: Path = args.out
    if (out / "model.safetensors").exists() and not args.force and not args.no_save:
        print(f"[train] exists: {out}/model.safetensors, use --force to retrain")
        return
    if not (out / "tokenizer.json").exists():
        sys.exit(f"[train] no tokenizer in {out}; run scripts/default_pair/tokenizer.py first")

    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(out)
    eos_id = tokenizer.eos_token_id
    vocab_size = len(tokenizer)
    train_stream = tokenize_split(out, "train")
    heldout_stream = tokenize_split(out, "heldout")
    print(f"[train] tokens: train={len(train_stream):,} heldout={len(heldout_stream):,} vocab={vocab_size}")

    model = build_model(args, vocab_size, eos_id)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.get_input_embeddings().weight.numel()
    print(f"[train] params: {n_params:,} ({n_params - n_embed:,} non-embedding)")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, args.beta2), eps=1e-8,
    )
    fwd_model = torch.compile(model) if args.compile else model

    batches = Batches(train_stream, args.seq_len, args.batch_size, args.seed)
    quick_eval = eval_windows(heldout_stream, args.seq_len, max_windows=32)
    compile_s = 0.0
    if args.compile:
        # Compile (forward + backward graphs) on the first batch before the clock starts; no optimizer
        # step, so the run is unchanged apart from speed.
        tc = time.time()
        warm = next(Batches(train_stream, args.seq_len, args.batch_size, args.seed))
        lm_loss(fwd_model, warm, args.autocast_bf16).backward()
        opt.zero_grad(set_to_none=True)
        compile_s = time.time() - tc
        print(f"[train] compiled in {compile_s:.0f}s")
    budget_s = args.minutes * 60 if args.minutes > 0 else float("inf")
    max_steps = args.max_steps if args.max_steps > 0 else None
    log: list[dict] = []
    losses: list[float] = []
    tokens_per_step = args.batch_size * args.seq_len

    model.train()
    pbar = tqdm(total=max_steps, dynamic_ncols=True, mininterval=5.0, desc="train")
    t0 = time.time()
    eval_time = 0.0
    step = 0
    while True:
        elapsed = time.time() - t0 - eval_time
        progress = max(step / max_steps if max_steps else 0.0, elapsed / budget_s)
        if progress >= 1.0:
            break
        lr = lr_at(step, progress, args)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = next(batches)
        loss = lm_loss(fwd_model, batch, args.autocast_bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        step += 1
        lv = loss.item()
        losses.append(lv)
        tps = step * tokens_per_step / max(time.time() - t0 - eval_time, 1e-9)
        pbar.update(1)
        pbar.set_postfix(loss=f"{lv:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}", ep=batches.epoch, refresh=False)
        rec = {"step": step, "loss": lv, "lr": lr, "grad_norm": gnorm, "elapsed_s": round(elapsed, 2), "tok_s": round(tps)}
        if args.eval_every and step % args.eval_every == 0:
            te = time.time()
            rec["heldout_quick"] = evaluate(model, quick_eval, args.eval_batch_size, False)
            eval_time += time.time() - te
            tqdm.write(f"[train] step {step} loss(avg50)={np.mean(losses[-50:]):.4f} "
                       f"heldout_quick={rec['heldout_quick']:.4f} tok/s={tps:,.0f} epoch={batches.epoch}")
        if step % 10 == 0 or "heldout_quick" in rec:
            log.append(rec)
        sys.stdout.flush()
    pbar.close()
    train_wall = time.time() - t0 - eval_time
    tokens_seen = step * tokens_per_step
    win = min(100, len(losses))
    final_train_loss = float(np.mean(losses[-win:]))
    print(f"[train] done: steps={step} tokens={tokens_seen:,} wall={train_wall / 60:.1f} min "
          f"tok/s={tokens_seen / train_wall:,.0f} final_train_loss={final_train_loss:.4f}")

    # Evaluate what is shipped: the bf16 weights, upcast to fp32.
    from copy import deepcopy

    model = model.to(torch.bfloat16)
    eval_model = deepcopy(model).to(torch.float32)
    ev = final_eval(eval_model, out, args.seq_len, args.eval_batch_size)
    print(f"[train] eval (bf16 weights): heldout loss={ev['heldout_loss']:.4f} ppl={ev['heldout_ppl']:.2f} | "
          f"train-sample loss={ev['train_loss']:.4f} ppl={ev['train_ppl']:.2f}")

    sample = greedy_sample(eval_model, tokenizer)
    print("[train] sample prompt:\n" + sample["prompt"] + "\n[train] greedy continuation:\n" + sample["completion"])

    if args.no_save:
        return
    model.config.use_cache = True
    model.generation_config = GenerationConfig(  # no max_new_tokens: it would override callers' max_length
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _clean_tokenizer_config(out)

    manifest = json.loads((CORPUS_DIR / "manifest.json").read_text())
    c = model.config
    stats = {
        "params": n_params,
        "params_non_embedding": n_params - n_embed,
        "params_m": n_params / 1e6,
        "config": {
            "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "intermediate_size": c.intermediate_size,
            "max_position_embeddings": c.max_position_embeddings, "rope_theta": args.rope_theta,
        },
        "corpus": {k: manifest[k] for k in ("python_version", "files", "bytes", "sha256", "skipped_too_large")},
        "tokenizer": {
            "vocab_size": vocab_size, "eos_id": eos_id, "mask_id": tokenizer.mask_token_id,
            "train_tokens": int(len(train_stream)), "heldout_tokens": int(len(heldout_stream)),
            "bytes_per_token": manifest["bytes"]["heldout"] / (len(heldout_stream) - manifest["files"]["heldout"]),
        },
        "training": {
            "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr, "min_lr_ratio": args.min_lr_ratio,
            "warmup_steps": args.warmup_steps, "weight_decay": args.weight_decay, "betas": [0.9, args.beta2],
            "autocast_bf16": args.autocast_bf16, "compile": args.compile, "seed": args.seed,
            "steps": step, "tokens_seen": tokens_seen, "epochs": tokens_seen / len(train_stream),
            "tokens_per_s": tokens_seen / train_wall, "train_wall_s": train_wall,
            "total_wall_s": time.time() - t_start, "compile_s": compile_s, "budget_minutes": args.minutes, "max_steps": args.max_steps,
            "final_train_loss": final_train_loss, "final_train_loss_window": win,
        },
        "eval": ev,
        "sample": sample,
        "machine": f"{os.cpu_count()}-core {_cpu_name()} CPU, no GPU, torch.set_num_threads({args.threads}), "
                   f"niceness {os.nice(0)}" + (f"; {args.machine_note}" if args.machine_note else ""),
        "argv": shlex.join(a for a in (argv if argv is not None else sys.argv[1:]) if a != "--force"),
        "git_commit": _git_commit(),
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "tokenizers": __import__("tokenizers").__version__,
        },
        "log": log,
    }
    (out / "train_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    write_card(out, stats)
    print(f"[train] saved to {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB in total)")


if __name__ == "__main__":
    sys.exit(main())
