"""Training data: read prompt/conversation records, tokenize them with the target's tokenizer, build examples.

Record formats accepted (one JSON object per line, a directory of `*.jsonl` shards, or a `datasets` dataset):
- `{"prompt_ids": [...], "response_ids": [...]}`: a regenerated record (`regenerate.py` writes these); loss on
  the response ids.
- `{"input_ids": [...], "loss_mask": [...]}` (loss_mask optional, default all ones except the first token):
  pre-tokenized data.
- `{"messages": [{"role", "content"}, ...]}`: a chat. The prompt is every message before the last assistant
  turn, rendered with the tokenizer's chat template (`add_generation_prompt=True`); the response is the rest of
  the rendered conversation. Without a chat template, messages are joined as "role: content" lines.
- `{"prompt": str, "response"|"completion"|"output": str}`, or `{"prompt": str}` / `{"text": str}` for
  regeneration (the prompt only). `{"text": str}` alone trains on the whole text.
`encode_prompt` gives the prompt ids of a record (for regeneration); `record_to_example` gives a training
`Example` (input_ids, loss_mask on response tokens only), truncated to `max_length`.

What this module does not know about: the model, anchors, batching across ranks (`trainer.py`); multi-turn chats
with several assistant turns are trained on the last assistant turn only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

RESPONSE_KEYS = ("response", "completion", "output")


@dataclass
class Example:
    input_ids: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T] bool, True on response tokens

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def read_records(source: str | Path, split: str = "train", limit: int | None = None) -> list[dict]:
    """Records from a JSONL file, a directory of JSONL shards, a saved dataset dir, or a `datasets` hub name."""
    path = Path(source)
    records: list[dict] = []
    if path.is_file():
        records = _read_jsonl(path)
    elif path.is_dir() and sorted(path.glob("*.jsonl")):
        for file in sorted(path.glob("*.jsonl")):
            records.extend(_read_jsonl(file))
    else:
        try:
            import datasets
        except ImportError as exc:
            raise FileNotFoundError(f"{source}: not a JSONL file or directory, and `datasets` is not installed "
                                    "(pip install 'flashdraft[train]')") from exc
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
        else:
            ds = datasets.load_dataset(str(source), split=split)
        if limit is not None:
            ds = ds.select(range(min(limit, len(ds))))
        records = [dict(r) for r in ds]
    return records[:limit] if limit is not None else records


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: invalid JSON: {exc}") from exc
    return out


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def _render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant: " if add_generation_prompt else "")


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    if tokenizer is None:
        raise ValueError("text records need a tokenizer (pass the target's tokenizer)")
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _split_messages(messages: list[dict]) -> tuple[list[dict], dict | None]:
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        return list(messages), None
    return list(messages[:last]), messages[last]


def encode_prompt(record: dict, tokenizer) -> list[int]:
    """The prompt token ids of a record (the conversation up to the last assistant turn, or the plain prompt)."""
    if "prompt_ids" in record:
        return [int(t) for t in record["prompt_ids"]]
    if "messages" in record:
        prompt_msgs, _ = _split_messages(record["messages"])
        if not prompt_msgs:
            raise ValueError("a chat record needs at least one message before the assistant turn")
        special = not has_chat_template(tokenizer)
        return _encode(tokenizer, _render_chat(tokenizer, prompt_msgs, add_generation_prompt=True), special)
    for key in ("prompt", "text", "instruction", "question"):
        if key in record and isinstance(record[key], str):
            text = record[key]
            if has_chat_template(tokenizer):
                return _encode(tokenizer, _render_chat(tokenizer, [{"role": "user", "content": text}], True), False)
            return _encode(tokenizer, text, True)
    raise ValueError(f"record has no prompt field (messages, prompt, text, prompt_ids); keys: {sorted(record)}")


def build_example(prompt_ids: list[int], response_ids: list[int], max_length: int | None = None) -> Example:
    """input_ids = prompt + response, loss_mask on the response only; truncated to max_length."""
    ids = list(prompt_ids) + list(response_ids)
    mask = [False] * len(prompt_ids) + [True] * len(response_ids)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return Example(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool))


def record_to_example(record: dict, tokenizer=None, max_length: int | None = None,
                      eos_token_id: int | None = None) -> Example:
    """A training example (loss on response tokens only) from any supported record format."""
    if "prompt_ids" in record and "response_ids" in record:
        return build_example(record["prompt_ids"], record["response_ids"], max_length)
    if "input_ids" in record:
        ids = [int(t) for t in record["input_ids"]]
        mask = record.get("loss_mask")
        mask = [bool(m) for m in mask] if mask is not None else [False] + [True] * (len(ids) - 1)
        if len(mask) != len(ids):
            raise ValueError(f"loss_mask has {len(mask)} entries for {len(ids)} input_ids")
        if max_length is not None:
            ids, mask = ids[:max_length], mask[:max_length]
        return Example(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool))
    if "messages" in record:
        prompt_msgs, answer = _split_messages(record["messages"])
        if answer is None:
            raise ValueError("a chat record for training needs an assistant turn (regenerate it first)")
        special = not has_chat_template(tokenizer)
        prompt_text = _render_chat(tokenizer, prompt_msgs, add_generation_prompt=True)
        full_text = _render_chat(tokenizer, prompt_msgs + [answer], add_generation_prompt=False)
        if full_text.startswith(prompt_text):
            response_ids = _encode(tokenizer, full_text[len(prompt_text):], False)
        else:  # templates that rewrite earlier turns: fall back to the answer content plus EOS
            response_ids = _encode(tokenizer, answer["content"], False) + ([eos_token_id] if eos_token_id is not None else [])
        return build_example(_encode(tokenizer, prompt_text, special), response_ids, max_length)
    if "prompt" in record and any(k in record for k in RESPONSE_KEYS):
        response = next(record[k] for k in RESPONSE_KEYS if k in record)
        response_ids = _encode(tokenizer, response, False) + ([eos_token_id] if eos_token_id is not None else [])
        return build_example(encode_prompt({"prompt": record["prompt"]}, tokenizer), response_ids, max_length)
    if "text" in record:
        ids = _encode(tokenizer, record["text"], True)
        return build_example(ids[:1], ids[1:], max_length)
    raise ValueError(f"cannot build a training example from a record with keys {sorted(record)}")


def load_examples(source: str | Path, tokenizer=None, max_length: int | None = None, split: str = "train",
                  limit: int | None = None, eos_token_id: int | None = None, min_response_tokens: int = 1) -> list[Example]:
    """All examples of `source` with at least `min_response_tokens` loss tokens after truncation."""
    out = []
    for record in read_records(source, split, limit):
        ex = record_to_example(record, tokenizer, max_length, eos_token_id)
        if int(ex.loss_mask.sum()) >= min_response_tokens:
            out.append(ex)
    return out


def load_prompts(source: str | Path, tokenizer=None, split: str = "train", limit: int | None = None) -> list[list[int]]:
    """Prompt token ids of every record of `source` (for regeneration and tau evaluation)."""
    return [encode_prompt(r, tokenizer) for r in read_records(source, split, limit)]
