"""Coverage prompts for drafter training: contexts cut from the TRAIN split of the target's corpus the way people
prompt a code model, so the drafter sees every kind of context the target will be asked to continue.

A prompt starts at a line start of a random train file and holds about L tokens, L drawn from short (16-256),
medium (256-1024) and long (1024-1900: the target's 2048-token window minus room for 128 new tokens) contexts.
It ends in one of these ways (`ENDINGS`):
- `line-start`: right after a newline (how code prompts usually end; the target often loops from here),
- `mid-line`: after a whole token inside a line,
- `mid-token`: at a random character inside a line (a half-typed word: the last token is a fragment),
- `blank-lines`: after one or two extra empty lines (the target's blank-line runs),
- `comment`: after an opened comment (`#`, `# ` or a `#` line and a newline: the target's comment runs).
A share of the prompts is written as chat (`{"messages": [...]}`): the target's chat template passes the last user
message through verbatim, so the tokens equal the raw prompt's and the drafter learns nothing new from them, but a
target with a real template gets its chat format covered by the same builder.

The responses, and with them the target's degenerate modes (loops, blank lines, comment runs), come from the
target itself (`flashdraft regenerate`); this module only cuts prompts. Never reads the held-out split.

`package_documents` gives the same cutter code the target never saw: the Python sources of installed third-party
packages (`FOREIGN_PACKAGES`), so the drafter also learns what the target does on unfamiliar code. The
out-of-domain evaluation sets cut their prompts from transformers and torch (`flashdraft.bench.datasets`): those,
the packages that share their code, and this project are never read here.

    from scripts.default_pair.coverage import coverage_prompts, cut_context
"""

from __future__ import annotations

import random

# installed with the project's extras, disjoint from the out-of-domain sets' transformers / torch (and the
# Hugging Face and torch packages that share code with them)
FOREIGN_PACKAGES = ("numpy", "scipy", "pandas", "matplotlib", "sympy", "networkx", "setuptools", "pip", "pydantic",
                    "starlette", "fastapi", "httpx", "httpcore", "anyio", "rich", "pygments", "jinja2", "click",
                    "typer", "uvicorn", "requests", "urllib3", "yaml", "aiohttp", "werkzeug", "pyparsing",
                    "hypothesis", "dateutil", "openai")
OUT_OF_DOMAIN_SOURCES = ("transformers", "torch", "torchgen", "functorch", "datasets", "huggingface_hub",
                         "tokenizers", "safetensors", "flashdraft")
ENDINGS = ("line-start", "mid-line", "mid-token", "blank-lines", "comment")
# (low, high) token counts and their shares
LENGTHS = (((16, 256), 0.4), ((256, 1024), 0.3), ((1024, 1900), 0.3))


def cut_context(text: str, tokenizer, tokens: int, ending: str, rng: random.Random | None = None) -> str | None:
    """The start of `text` (which begins at a line start) holding at most `tokens` tokens, cut to end as `ending`
    says (`ENDINGS`, or `newline` = `line-start`); None when the cut would leave less than half of it or cannot
    end that way. `rng` picks the character of a mid-token cut and the comment / blank-line variant."""
    rng = rng or random.Random(0)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < tokens + 8:
        return None
    head = tokenizer.decode(ids[:tokens])
    if ending in ("line-start", "newline", "blank-lines", "comment"):
        piece = head[:head.rfind("\n") + 1]
        previous = piece.splitlines()[-1] if piece.strip() else ""
        indent = previous[:len(previous) - len(previous.lstrip())]
        if ending == "blank-lines":
            piece += "\n" * rng.randint(1, 2)
        elif ending == "comment":
            piece += indent + rng.choice(("#", "# ", "#\n", "# " + "-" * rng.randint(3, 40) + "\n"))
    else:
        piece = head.rstrip()
        last = piece.splitlines()[-1] if piece.strip() else ""
        if not last.strip():
            return None
        if ending == "mid-token":
            stripped = len(last) - len(last.lstrip())
            if len(last) - stripped < 2:
                return None
            piece = piece[:len(piece) - len(last) + rng.randint(stripped + 1, len(last) - 1)]
        elif ending != "mid-line":
            raise ValueError(f"unknown ending {ending!r}; choose from {ENDINGS}")
    if len(piece) < len(head) // 2 or not piece.strip():
        return None
    return piece


def package_documents(packages: tuple[str, ...] = FOREIGN_PACKAGES, per_package: int = 100,
                      max_bytes: int = 200 * 1024) -> list[str]:
    """The Python sources of the installed `packages` (those not installed are skipped), test and vendored folders
    and files over `max_bytes` left out, at most `per_package` files of each (a deterministic sample: openai's
    generated types alone hold 1,500 files, sympy 850, where click has 17), so every project weighs alike.
    Refuses the out-of-domain evaluation's sources."""
    from flashdraft.bench.datasets import DatasetUnavailable, _source_files

    clash = set(packages) & set(OUT_OF_DOMAIN_SOURCES)
    if clash:
        raise ValueError(f"{sorted(clash)}: the out-of-domain evaluation cuts its prompts from these")
    documents = []
    for name in packages:
        try:
            paths = _source_files((name,), skip_dirs=frozenset({"test", "tests", "testing", "_vendor", "vendor"}))
        except DatasetUnavailable:  # not installed
            continue
        paths = [path for path in paths if path.stat().st_size <= max_bytes]
        if len(paths) > per_package:
            paths = random.Random(name).sample(paths, per_package)
        documents += [path.read_text(errors="replace") for path in paths]
    if not documents:
        raise ValueError(f"none of {packages} is installed")
    return documents


def coverage_prompts(documents: list[str], tokenizer, num: int, seed: int = 0, chat_share: float = 0.1) -> list[dict]:
    """`num` prompt records (`{"prompt": ...}` or `{"messages": [...]}`, with `ending` and `tokens` for the record)
    cut from `documents` (train files only), endings in equal shares, lengths as `LENGTHS`. Deterministic."""
    rng = random.Random(seed)
    docs = [d for d in documents if d.count("\n") >= 20]
    spans, weights = zip(*LENGTHS)
    out = []
    while len(out) < num:
        ending = ENDINGS[len(out) % len(ENDINGS)]
        low, high = rng.choices(spans, weights)[0]
        tokens = rng.randint(low, high)
        lines = rng.choice(docs).splitlines(keepends=True)
        start = rng.randrange(len(lines) - 10)
        text = cut_context("".join(lines[start:start + tokens // 2 + 40]), tokenizer, tokens, ending, rng)
        if text is None:
            continue
        rec = {"messages": [{"role": "user", "content": text}]} if rng.random() < chat_share else {"prompt": text}
        out.append({**rec, "ending": ending, "tokens": tokens})
    return out
