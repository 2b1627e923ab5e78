"""Regenerate responses with the target itself: drafters train on the target's own outputs (docs/design.md, 'Training').

Design:
- Prompts (from `data.load_prompts`) are cut into shards of `shard_size`; shard i is written to
  `out_dir/shard-{i:05d}.jsonl` via a `.tmp` file and an atomic rename, so a file that exists is complete.
  Re-running skips complete shards (resumable after a kill; the partial `.tmp` is redone).
- Generation is plain batched decoding through `SpecEngine(target)` with no drafter (block size 1, the same
  lossless engine that serves); greedy by default, or sampled with a per-prompt seed `seed + index`, so a re-run
  regenerates the same shard identically.
- Under torchrun (or with `rank`/`world_size`), worker r does shards r, r + W, ...; no coordination needed.
- With `structured` every response follows that grammar (`engine.structured`): the target's answers in the shape
  users will ask for, so a drafter trained on them drafts that traffic.
- Each record: `{"index", "prompt_ids", "response_ids", "response_text" (with a tokenizer), "finish_reason"}`;
  `data.record_to_example` turns it into a training example. Generation stops at the target's context length;
  a prompt that fills it gets an empty response (`finish_reason: "prompt_too_long"`, dropped by training).

What this module does not know about: training; prompt filtering/dedup (give it the prompts you want).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


from flashdraft.engine import SamplingParams, SpecEngine


def shard_path(out_dir: Path, index: int) -> Path:
    return Path(out_dir) / f"shard-{index:05d}.jsonl"


def regenerate(
    model,
    prompts: list[list[int]],
    out_dir: str | Path,
    tokenizer=None,
    shard_size: int = 1000,
    batch_size: int = 32,
    max_new_tokens: int = 1024,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_ids: list[int] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    progress: bool = True,
    structured=None,
) -> list[Path]:
    """Write the shards this worker owns; returns the paths of all shards this worker is responsible for.

    Refused (ValueError) before anything is written: shard_size / batch_size / max_new_tokens below 1, and a
    model whose weights hold NaN or inf (it would answer every prompt with the same token)."""
    from flashdraft.loading import check_finite_weights

    for name, value in (("shard_size", shard_size), ("batch_size", batch_size), ("max_new_tokens", max_new_tokens)):
        if int(value) < 1:
            raise ValueError(f"regenerate: {name} must be >= 1, got {value}")
    check_finite_weights(model, "regenerate: the target")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    engine = SpecEngine(model, tokenizer=tokenizer)
    stops = tuple(engine.eos_token_ids if stop_ids is None else stop_ids)
    max_positions = getattr(engine.target.config, "max_position_embeddings", None) or 10**9

    def room(i: int) -> int:
        return min(max_new_tokens, max_positions - len(prompts[i]))

    num_shards = (len(prompts) + shard_size - 1) // shard_size
    mine = [i for i in range(num_shards) if i % world_size == rank]
    todo = [i for i in mine if not shard_path(out_dir, i).exists()]
    total = sum(min(shard_size, len(prompts) - i * shard_size) for i in todo)
    bar = None
    if progress and total:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=f"regenerate[{rank}]", unit="prompt", position=rank)
    try:
        for shard in todo:
            start = shard * shard_size
            idx = list(range(start, min(len(prompts), start + shard_size)))
            order = sorted(idx, key=lambda i: len(prompts[i]))  # similar lengths together: less padding
            results = {}
            for b in range(0, len(order), batch_size):
                batch = [i for i in order[b:b + batch_size] if room(i) >= 1]
                for i in order[b:b + batch_size]:
                    if room(i) < 1:  # the prompt fills the target's context: nothing to generate
                        results[i] = None
                if bar is not None:
                    bar.update(len(order[b:b + batch_size]) - len(batch))
                if not batch:
                    continue
                params = [SamplingParams(max_new_tokens=min(max_new_tokens, room(i)), temperature=temperature,
                                         top_p=top_p, top_k=top_k, stop_token_ids=stops,
                                         seed=None if temperature == 0 else seed + i, structured=structured)
                          for i in batch]
                for i, res in zip(batch, engine.generate([prompts[i] for i in batch], params)):
                    results[i] = res
                if bar is not None:
                    bar.update(len(batch))
            final = shard_path(out_dir, shard)
            tmp = final.with_name(final.name + ".tmp")
            with open(tmp, "w") as f:
                for i in idx:
                    res = results[i]
                    if res is None:
                        f.write(json.dumps({"index": i, "prompt_ids": list(prompts[i]), "response_ids": [],
                                            "finish_reason": "prompt_too_long"}) + "\n")
                        continue
                    rec = {"index": i, "prompt_ids": list(prompts[i]), "response_ids": res.token_ids,
                           "finish_reason": res.finish_reason}
                    if tokenizer is not None:
                        rec["response_text"] = tokenizer.decode(res.token_ids, skip_special_tokens=True)
                    f.write(json.dumps(rec) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
    finally:
        if bar is not None:
            bar.close()
    return [shard_path(out_dir, i) for i in mine]
