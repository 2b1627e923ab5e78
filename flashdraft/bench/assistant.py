"""Train the small autoregressive draft model that the `hf-assisted` baseline uses.

transformers' assisted generation needs a draft LM that shares the target's tokenizer. For a fair comparison with
DFlash it is trained on the same regenerated data (`flashdraft regenerate` shards: JSONL records with `prompt_ids`
and `response_ids`, the target's own outputs) with the plain next-token loss: a Qwen3 decoder with tied
embeddings, sized to ~1-2M parameters for the default pair (vocab 8192, hidden 128, 2 layers), saved in bf16.

    python -m flashdraft.bench.assistant --data data/default_pair/regen_mix --target flashdraft/assets/default_pair/target \
        --output-dir flashdraft/assets/default_pair/assistant --minutes 10

`train_assistant(...)` is the same from Python. The loss covers every token after the first (`--loss-on
response` restricts it to the regenerated responses); 2% of the records (at most 200) are held out for the
reported next-token accuracy, a proxy for the per-token acceptance rate in greedy assisted generation.

What this module does not know about: DFlash drafters (that is `flashdraft train`), distillation from target logits.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch


def _records(data: str | Path) -> list[tuple[list[int], list[int]]]:
    from flashdraft.train.data import read_records

    out = []
    for r in read_records(data):
        if "prompt_ids" not in r or "response_ids" not in r:
            raise ValueError(f"{data}: records need 'prompt_ids' and 'response_ids' (as `flashdraft regenerate` writes)")
        if r["response_ids"]:
            out.append(([int(t) for t in r["prompt_ids"]], [int(t) for t in r["response_ids"]]))
    if not out:
        raise ValueError(f"{data}: no records with a non-empty response")
    return out


def make_assistant_config(target_config, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                          num_kv_heads: int = 2, head_dim: int = 32, intermediate_size: int = 384):
    from transformers import Qwen3Config

    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default",
                                                     "rope_theta": getattr(tc, "rope_theta", 10000.0)}
    return Qwen3Config(vocab_size=tc.vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                       num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                       head_dim=head_dim, max_position_embeddings=tc.max_position_embeddings,
                       rope_parameters=dict(rope), tie_word_embeddings=True,
                       bos_token_id=getattr(tc, "bos_token_id", None), eos_token_id=getattr(tc, "eos_token_id", None),
                       pad_token_id=getattr(tc, "pad_token_id", None))


def _batches(examples, batch_size: int, rng: random.Random):
    """Length-bucketed shuffled batches: sort a shuffled window by length, cut it into batches, shuffle those."""
    idx = list(range(len(examples)))
    rng.shuffle(idx)
    window = batch_size * 32
    batches = []
    for s in range(0, len(idx), window):
        chunk = sorted(idx[s:s + window], key=lambda i: len(examples[i][0]))
        batches += [chunk[b:b + batch_size] for b in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def _collate(examples, ids, pad: int, device):
    width = max(len(examples[i][0]) for i in ids)
    x = torch.full((len(ids), width), pad, dtype=torch.long)
    y = torch.full((len(ids), width), -100, dtype=torch.long)
    att = torch.zeros((len(ids), width), dtype=torch.long)
    for row, i in enumerate(ids):
        tokens, mask = examples[i]
        n = len(tokens)
        x[row, :n] = torch.tensor(tokens)
        att[row, :n] = 1
        lab = torch.tensor(tokens[1:] + [-100])
        keep = torch.tensor(mask[1:] + [False])
        y[row, :n] = torch.where(keep, lab, torch.full_like(lab, -100))
    return x.to(device), y.to(device), att.to(device)


@torch.no_grad()
def next_token_accuracy(model, examples, pad: int, device, batch_size: int = 16) -> float:
    model.eval()
    hit = total = 0
    for b in range(0, len(examples), batch_size):
        x, y, att = _collate(examples, list(range(b, min(b + batch_size, len(examples)))), pad, device)
        pred = model(input_ids=x, attention_mask=att).logits.argmax(-1)
        valid = y != -100
        hit += int((pred == y)[valid].sum())
        total += int(valid.sum())
    model.train()
    return hit / total if total else 0.0


def train_assistant(data: str | Path, target: str | Path, output_dir: str | Path, *, hidden_size: int = 128,
                    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32,
                    intermediate_size: int = 384, max_length: int = 512, batch_size: int = 16, lr: float = 3e-3,
                    weight_decay: float = 0.01, warmup_steps: int = 50, epochs: float = 3.0,
                    max_steps: int | None = None, minutes: float | None = None, loss_on: str = "all",
                    seed: int = 0, device: str | None = None, save_dtype: str = "bfloat16",
                    log_every: int = 50, log=print) -> dict:
    """Train and save the assistant; returns the training summary (also written to the model card)."""
    from transformers import AutoConfig, Qwen3ForCausalLM

    if loss_on not in ("all", "response"):
        raise ValueError(f"loss_on must be 'all' or 'response', got {loss_on!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    records = _records(data)
    rng.shuffle(records)
    n_val = min(200, max(1, len(records) // 50)) if len(records) > 1 else 0
    examples = []
    for prompt, response in records:
        tokens = (prompt + response)[:max_length]
        mask = ([loss_on == "all"] * len(prompt) + [True] * len(response))[:max_length]
        if len(tokens) >= 2 and any(mask[1:]):
            examples.append((tokens, mask))
    val, train = examples[:n_val], examples[n_val:] or examples
    tcfg = AutoConfig.from_pretrained(str(target))
    config = make_assistant_config(tcfg, hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
                                   intermediate_size)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    model = Qwen3ForCausalLM(config).to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    steps_per_epoch = math.ceil(len(train) / batch_size)
    total_steps = max_steps or max(1, int(epochs * steps_per_epoch))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay,
                                                                                 "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))

    def lr_at(step):
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        frac = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    log(f"assistant: {n_params / 1e6:.2f}M params, {len(train)} train / {len(val)} held-out sequences, "
        f"{total_steps} steps planned, device {device}")
    start = time.time()
    step, losses, done = 0, [], False
    while not done:
        for ids in _batches(train, batch_size, rng):
            x, y, att = _collate(train, ids, pad, device)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            logits = model(input_ids=x, attention_mask=att).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            step += 1
            if log_every and step % log_every == 0:
                log(f"step {step}/{total_steps} loss {sum(losses[-log_every:]) / len(losses[-log_every:]):.4f} "
                    f"lr {lr_at(step):.2e} {time.time() - start:.0f}s")
            if step >= total_steps or (minutes is not None and time.time() - start > 60 * minutes):
                done = True
                break
    acc = next_token_accuracy(model, val, pad, device) if val else None
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[save_dtype]
    model.to(dtype).save_pretrained(out)
    summary = {"params": n_params, "steps": step, "train_sequences": len(train), "heldout_sequences": len(val),
               "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4), "heldout_next_token_accuracy":
               None if acc is None else round(acc, 4), "minutes": round((time.time() - start) / 60, 2),
               "data": str(data), "target": str(target), "loss_on": loss_on, "max_length": max_length,
               "batch_size": batch_size, "lr": lr, "seed": seed, "dtype": save_dtype,
               "architecture": {"hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
                                "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                                "intermediate_size": intermediate_size, "tie_word_embeddings": True}}
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2))
    (out / "README.md").write_text(_model_card(summary))
    log(f"saved to {out}: loss {summary['final_loss']}, held-out next-token accuracy "
        f"{summary['heldout_next_token_accuracy']}")
    return summary


def _model_card(s: dict) -> str:
    a = s["architecture"]
    return f"""# hf-assisted draft model (benchmark baseline)

A small autoregressive Qwen3 decoder ({s['params'] / 1e6:.2f}M parameters, {a['num_layers']} layers, hidden
{a['hidden_size']}, {a['num_heads']} heads / {a['num_kv_heads']} KV heads, tied embeddings, {s['dtype']}) that shares the
target's tokenizer. It is the draft model of the `hf-assisted` method of `flashdraft bench` (transformers assisted
generation, `num_assistant_tokens` fixed, confidence threshold 0), so DFlash is compared with a classic draft
model trained on the same data.

- Target: `{s['target']}`; data: `{s['data']}` (the target's own regenerated responses, `flashdraft regenerate`).
- Training: plain next-token cross-entropy on {'all tokens' if s['loss_on'] == 'all' else 'response tokens'},
  {s['steps']} steps, batch {s['batch_size']}, max length {s['max_length']}, AdamW lr {s['lr']} (warmup, cosine to 10%),
  seed {s['seed']}, {s['minutes']} min.
- Result: final training loss {s['final_loss']}; next-token accuracy on {s['heldout_sequences']} held-out sequences
  {s['heldout_next_token_accuracy']}.

Reproduce: `python -m flashdraft.bench.assistant --data {s['data']} --target {s['target']} --output-dir <dir>`
(see `flashdraft/bench/assistant.py`).
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashdraft.bench.assistant",
                                description="Train the small AR draft model for the hf-assisted benchmark baseline")
    p.add_argument("--data", required=True, help="regenerated shards (dir of JSONL with prompt_ids/response_ids)")
    p.add_argument("--target", required=True, help="target model dir (its config gives vocab, positions, RoPE)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--intermediate-size", type=int, default=384)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--minutes", type=float, default=None, help="stop after this much training time")
    p.add_argument("--loss-on", choices=["all", "response"], default="all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--save-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        train_assistant(a.data, a.target, a.output_dir, hidden_size=a.hidden_size, num_layers=a.num_layers,
                        num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                        intermediate_size=a.intermediate_size, max_length=a.max_length, batch_size=a.batch_size,
                        lr=a.lr, epochs=a.epochs, max_steps=a.max_steps, minutes=a.minutes, loss_on=a.loss_on,
                        seed=a.seed, device=a.device, save_dtype=a.save_dtype)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
