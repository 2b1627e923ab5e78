"""Benchmark prompts: the standard speculative-decoding sets, local JSONL files, and the default pair's held-out set.

- `gsm8k`, `math500`, `humaneval`, `mbpp`, `mt-bench`: read once through `datasets` (needs the hub), then cached as
  JSONL (`{"prompt": ...}` or `{"messages": [...]}` per line) under the cache dir; later runs (and offline machines
  with a copied cache) read the cache. Offline and not cached: `DatasetUnavailable` with what to do.
- a path to a `.jsonl` file: one object per line with a `prompt` (string) or `messages` (chat) field.
- `default`: the shipped default pair's held-out code prompts (`flashdraft.demo.load_heldout_prompts`).
- `ood-code`, `ood-code-nl`: code the shipped pair never saw, cut from installed packages' sources (transformers,
  torch), ending mid-line or right after a newline (`source_prompts`); no download.

Prompt wording follows the DFlash/EAGLE evaluation scripts: math sets ask for step-by-step reasoning and a boxed
answer, code sets ask for a solution; mt-bench uses the first turn.

What this module does not know about: tokenization and chat templates (`Prompt.encode` applies them).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE_DIR = Path(os.environ.get("FLASHDRAFT_BENCH_CACHE", Path.home() / ".cache" / "flashdraft" / "bench"))

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def _math(field):
    return lambda r: r[field] + MATH_SUFFIX


def _humaneval(r):
    return ("Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
            f"{r['prompt']}\n```")


def _mbpp(r):
    tests = "\n".join(r.get("test_list") or [])
    return f"{r['text']}\nYour code should pass these tests:\n{tests}" if tests else r["text"]


def _mt_bench(r):
    turns = r.get("prompt") or r.get("turns")
    return turns[0] if isinstance(turns, list) else turns


# name -> (hub id, config, split, record -> prompt text)
BUILTIN = {
    "gsm8k": ("openai/gsm8k", "main", "test", _math("question")),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", _math("problem")),
    "humaneval": ("openai/openai_humaneval", None, "test", _humaneval),
    "mbpp": ("google-research-datasets/mbpp", "full", "test", _mbpp),
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train", _mt_bench),
}
CHAT_DATASETS = {"gsm8k", "math500", "humaneval", "mbpp", "mt-bench"}  # instructions: meant for chat models


class DatasetUnavailable(ValueError):
    """A dataset is neither cached nor downloadable (offline): a user error, reported in one line."""


@dataclass
class Prompt:
    text: str | None = None
    messages: list[dict] | None = None

    def as_messages(self) -> list[dict]:
        return self.messages if self.messages is not None else [{"role": "user", "content": self.text}]

    def encode(self, tokenizer, chat: bool) -> list[int]:
        """Token ids: chat messages (or `chat=True`) through the chat template, plain text as is."""
        if self.messages is not None or chat:
            if getattr(tokenizer, "chat_template", None):
                return list(tokenizer.apply_chat_template(self.as_messages(), add_generation_prompt=True,
                                                          tokenize=True, return_dict=False))
            if self.messages is not None:  # no template: "role: content" lines, as the training data does
                text = "\n".join(f"{m['role']}: {m['content']}" for m in self.messages) + "\nassistant: "
                return _plain(tokenizer, text)
        return _plain(tokenizer, self.text)

    def to_json(self) -> dict:
        return {"messages": self.messages} if self.messages is not None else {"prompt": self.text}


def _plain(tokenizer, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        ids = [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id]
    return list(ids)


def _record_to_prompt(rec: dict, where: str) -> Prompt:
    if isinstance(rec.get("messages"), list) and rec["messages"]:
        msgs = [dict(m) for m in rec["messages"]]
        if msgs[-1].get("role") == "assistant":  # a full conversation: benchmark the last assistant turn
            msgs = msgs[:-1]
        if not msgs:
            raise ValueError(f"{where}: 'messages' has no turn before the assistant's")
        return Prompt(messages=msgs)
    if isinstance(rec.get("prompt"), str):
        return Prompt(text=rec["prompt"])
    raise ValueError(f"{where}: each line needs a 'prompt' string or a 'messages' list (got keys {sorted(rec)})")


def read_jsonl(path: str | Path) -> list[Prompt]:
    path = Path(path)
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from exc
            prompts.append(_record_to_prompt(rec, f"{path}:{n}"))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def cache_path(name: str, cache_dir: str | Path | None = None) -> Path:
    return Path(cache_dir or DEFAULT_CACHE_DIR) / f"{name}.jsonl"


def _hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub cannot be reached (a quick TCP connect), or None. Skipped behind a proxy: the proxy decides."""
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError as exc:
        return f"cannot connect to {url.hostname}: {exc}"
    return None


def download(name: str, cache_dir: str | Path | None = None) -> Path:
    """Fetch a built-in set through `datasets` and write its JSONL cache."""
    hub, config, split, fmt = BUILTIN[name]
    target = cache_path(name, cache_dir)
    try:
        offline = os.environ.get("HF_HUB_OFFLINE") not in (None, "", "0") or \
            os.environ.get("HF_DATASETS_OFFLINE") not in (None, "", "0")
        why = "offline mode (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)" if offline else _hub_unreachable()
        if why:  # fail fast instead of datasets' retries with back-off
            raise ConnectionError(why)
        import datasets

        ds = datasets.load_dataset(hub, config, split=split) if config else datasets.load_dataset(hub, split=split)
        rows = [{"prompt": fmt(dict(r))} for r in ds]
    except Exception as exc:  # offline, hub unreachable, datasets missing
        raise DatasetUnavailable(
            f"dataset '{name}' is not cached at {target} and could not be downloaded from the hub ({hub}): "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}\n"
            f"  - run once on a machine with internet (the cache is plain JSONL; copy it to {target}), or\n"
            f"  - pass a local file: --dataset path.jsonl (one {{\"prompt\": ...}} or {{\"messages\": [...]}} per line)"
        ) from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, target)
    return target


def load_prompts(spec: str, num_prompts: int | None = None, cache_dir: str | Path | None = None) -> list[Prompt]:
    """Prompts for a dataset name (`default`, a built-in name) or a JSONL path; the first `num_prompts`."""
    if spec == "default":
        from flashdraft.demo import load_heldout_prompts

        prompts = [Prompt(text=t) for t in load_heldout_prompts()]
    elif spec in SOURCE_SETS:
        prompts = [Prompt(text=s) for s in source_prompts(num_prompts or 64, SOURCE_SETS[spec])]
    elif spec in BUILTIN:
        path = cache_path(spec, cache_dir)
        if not path.is_file():
            path = download(spec, cache_dir)
        prompts = read_jsonl(path)
    elif Path(spec).is_file():
        prompts = read_jsonl(spec)
    else:
        raise FileNotFoundError(f"unknown dataset {spec!r}: use default, {', '.join([*SOURCE_SETS, *BUILTIN])}, or a "
                                "path to a .jsonl file")
    return prompts[:num_prompts] if num_prompts else prompts


def dataset_label(spec: str) -> str:
    return spec if spec in BUILTIN or spec in ("default", *SOURCE_SETS) else Path(spec).stem


# out-of-domain code prompts cut from installed packages' sources (no download): mid-line, or ending in a newline
SOURCE_SETS = {"ood-code": False, "ood-code-nl": True}


def _source_files(packages: tuple[str, ...], skip_dirs: frozenset[str] = frozenset()) -> list[Path]:
    """The installed `packages`' Python files, sorted per package folder; `skip_dirs`: folder names (inside a
    package) whose files are left out."""
    import importlib.util

    files = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in spec.submodule_search_locations:
            files += [path for path in sorted(Path(root).rglob("*.py"))
                      if not skip_dirs.intersection(path.relative_to(root).parts[:-1])]
    if not files:
        raise DatasetUnavailable(f"none of {packages} is installed to cut source prompts from")
    return files


def source_prompts(num: int, end_at_line_start: bool, chars: int = 320,
                   packages: tuple[str, ...] = ("transformers", "torch"), seed: int = 0) -> list[str]:
    """`num` code prompts of about `chars` characters from installed packages' Python sources, each starting at a
    line start and ending right after a newline (`end_at_line_start`) or mid-line: the `ood-code` / `ood-code-nl`
    benchmark sets. Deterministic per seed and installed package versions."""
    import random

    files, rng, out = _source_files(packages), random.Random(seed), []
    while len(out) < num:
        lines = rng.choice(files).read_text(errors="replace").splitlines(keepends=True)
        if len(lines) < 20:
            continue
        start = rng.randrange(len(lines) - 10)
        text = "".join(lines[start:start + 60])[:chars]
        cut = text.rfind("\n") + 1 if end_at_line_start else len(text.rstrip("\n"))
        text = text[:cut]
        if len(text) < chars // 2 or not text.strip() or (not end_at_line_start and text.endswith("\n")):
            continue
        out.append(text)
    return out


def source_contexts(tokenizer, num: int, tokens: int = 64, packages: tuple[str, ...] = ("transformers", "torch"),
                    seed: int = 0, end_at_line_start: bool | None = None) -> list[list[int]]:
    """`num` contexts of `tokens` tokens cut from installed packages' Python sources: code the shipped pair never
    saw (it was trained on the standard library), for out-of-domain measurements without a download.

    Each context starts at a line start of a randomly chosen file; `end_at_line_start` True cuts it right after a
    newline (how code prompts usually end), False mid-line, None wherever `tokens` falls. Deterministic per seed
    and installed package versions.
    """
    import random

    files = _source_files(packages)
    rng = random.Random(seed)
    contexts: list[list[int]] = []
    while len(contexts) < num:
        lines = rng.choice(files).read_text(errors="replace").splitlines(keepends=True)
        if len(lines) < 20:
            continue
        start = rng.randrange(len(lines) - 10)
        ids = tokenizer("".join(lines[start:start + 200]), add_special_tokens=False)["input_ids"]
        if len(ids) < tokens + 8:
            continue
        ids = ids[:tokens]
        if end_at_line_start is not None:
            text = tokenizer.decode(ids)
            cut = text.rfind("\n") + 1 if end_at_line_start else len(text.rstrip("\n"))
            if end_at_line_start and cut < len(text) // 2:
                continue
            ids = tokenizer(text[:cut], add_special_tokens=False)["input_ids"]
            if not end_at_line_start and tokenizer.decode(ids).endswith("\n"):
                continue
        contexts.append(ids)
    return contexts
