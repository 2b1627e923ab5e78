"""Command-line pieces every `flashdraft` subcommand shares: one-line argument errors, checked argument types,
the model / device / precision flags, loading the models they name, and building the engine from them
(`engine_from_args`: the one place a command turns flags into a `SpecEngine`).

What this module does not know about: the subcommands themselves (`cli.py`, `demo.py`, `serve/cli.py`,
`bench/cli.py` import from here; nothing here imports them, so there is no import circle).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flashdraft.loading import DefaultPairMissing


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with errors on one line (`prog: error: ...`) instead of the usage block plus the error, and
    `--speculative-config` merged into the flags it stands for once a command's flags are all read."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        config = getattr(namespace, "speculative_config", None)
        if config is not None:
            try:
                merge_speculative_config(namespace, config)
            except ValueError as exc:
                self.error(str(exc))
        return namespace, extras


# vLLM's --speculative-config keys we read, with their types (method: "dflash" only, DFlash-1 or DFlash2 by checkpoint)
SPECULATIVE_CONFIG_KEYS = {"method": str, "model": str, "num_speculative_tokens": int, "disable_by_batch_size": int}


def speculative_config_arg(value: str) -> dict:
    """vLLM's `--speculative-config` JSON, e.g. '{"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16",
    "num_speculative_tokens": 15}': checked here, merged into --draft / --block-size /
    --speculative-disable-by-batch-size once every flag is read (`merge_speculative_config`)."""
    import json

    try:
        config = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    unknown = sorted(set(config) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(f"keys flashdraft does not read: {', '.join(unknown)} (it reads "
                                         f"{', '.join(SPECULATIVE_CONFIG_KEYS)})")
    for key, kind in SPECULATIVE_CONFIG_KEYS.items():
        if key in config and (not isinstance(config[key], kind) or isinstance(config[key], bool)):
            raise argparse.ArgumentTypeError(f"{key} must be {'a string' if kind is str else 'an integer'}, "
                                             f"got {config[key]!r}")
    if str(config.get("method", "dflash")).lower() != "dflash":
        raise argparse.ArgumentTypeError(f"method {config['method']!r}: flashdraft drafts with DFlash drafters only "
                                         "(method \"dflash\", DFlash-1 or DFlash2 checkpoints)")
    if config.get("num_speculative_tokens", 1) < 1:
        raise argparse.ArgumentTypeError(f"num_speculative_tokens must be >= 1, got {config['num_speculative_tokens']}")
    if config.get("disable_by_batch_size", 1) < 1:
        raise argparse.ArgumentTypeError(f"disable_by_batch_size must be >= 1, got {config['disable_by_batch_size']}")
    return config


def merge_speculative_config(args, config: dict) -> None:
    """`--speculative-config`'s keys into the flags they stand for (model -> --draft, num_speculative_tokens k ->
    --block-size k + 1, disable_by_batch_size -> --speculative-disable-by-batch-size); a flag given as well must
    say the same (ValueError otherwise)."""
    if getattr(args, "no_draft", False):
        raise ValueError("--no-draft and --speculative-config contradict each other")
    k = config.get("num_speculative_tokens")
    merged = (("draft", "--draft", None, "model", config.get("model")),
              ("block_size", "--block-size", None, f"num_speculative_tokens {k}, i.e. block size",
               None if k is None else k + 1),
              ("disable_by_batch_size", "--speculative-disable-by-batch-size", 0, "disable_by_batch_size",
               config.get("disable_by_batch_size")))
    for name, flag, unset, key, value in merged:
        if value is None:
            continue
        given = getattr(args, name, unset)
        if given not in (unset, value):
            raise ValueError(f"{flag} {given} and --speculative-config's {key} {value} differ")
        setattr(args, name, value)


# ---- argument types: every range check of the shared flags lives here -------------------------------------------

def int_at_least(low: int, note: str = ""):
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if number < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}{note}, got {number}")
        return number

    parse.__name__ = f"int >= {low}"
    return parse


def float_in(low: float, high: float | None = None, low_open: bool = False, note: str = ""):
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
        too_low = number <= low if low_open else number < low
        if too_low or (high is not None and number > high) or number != number:
            span = f"{'(' if low_open else '['}{low:g}, {high:g}]" if high is not None else (
                f"> {low:g}" if low_open else f">= {low:g}")
            raise argparse.ArgumentTypeError(f"must be {'in ' if high is not None else ''}{span}{note}, got {value}")
        return number

    parse.__name__ = "number"
    return parse


def device_arg(value: str) -> str:
    """auto, cpu, cuda, cuda:N (mps): checked now, so a machine without CUDA is told so before any model loads."""
    if value == "auto":
        return value
    from flashdraft.loading import resolve_device

    try:
        resolve_device(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def dtype_arg(value: str) -> str:
    from flashdraft.loading import DTYPE_NAMES

    if value != "auto" and value not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"unknown dtype {value!r}; use auto or one of {', '.join(DTYPE_NAMES)}")
    return value


def int_in(low: int, high: int, note: str = ""):
    """An integer in [low, high] (e.g. a seed, which torch and the data order hash: it must fit their ranges)."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"must be an integer in [{low}, {high}]{note}, got {number}")
        return number

    parse.__name__ = f"int in [{low}, {high}]"
    return parse


def finite_float_in(low: float, high: float | None = None, low_open: bool = False, note: str = ""):
    """`float_in`, and finite: inf (which `float_in` accepts when there is no upper bound) is refused."""
    inner = float_in(low, high, low_open, note)

    def parse(value: str) -> float:
        number = inner(value)
        if number in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"must be a finite number{note}, got {value}")
        return number

    parse.__name__ = "number"
    return parse


def output_dir_arg(value: str) -> str:
    """A directory to write into: it may not exist yet (it is created), but an existing file is refused."""
    from pathlib import Path

    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{value}: is a file, not a directory")
    for parent in path.parents:  # a file where a parent directory should be
        if parent.exists():
            if not parent.is_dir():
                raise argparse.ArgumentTypeError(f"{value}: {parent} is a file, not a directory")
            break
    return value


def data_source_arg(value: str) -> str:
    """A JSONL file, a directory, or a `datasets` hub name ("org/name"): a local-looking path (starting with
    / . ~, or ending in .json / .jsonl) must exist."""
    from pathlib import Path

    from flashdraft.loading import _HUB_ID

    path = Path(value).expanduser()
    if path.exists():
        return value
    if value.startswith(("/", ".", "~")) or value.endswith((".json", ".jsonl")) or not _HUB_ID.match(value):
        raise argparse.ArgumentTypeError(f"{value}: no such file or directory (and not a datasets name org/name)")
    return value


def model_path_arg(what: str):
    """--target / --draft: a local model directory (with config.json) or a hub id; checked before anything loads."""
    def parse(value: str) -> str:
        from flashdraft.loading import check_model_path

        try:
            check_model_path(value, what)
        except (ValueError, FileNotFoundError) as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--{what} ")) from None
        return value

    parse.__name__ = "model directory or hub id"
    return parse


def http_url_arg(value: str) -> str:
    """`URL` or `name=URL` where URL is http(s)://host[:port][/path] (a server to benchmark)."""
    from urllib.parse import urlsplit

    url = value.partition("=")[2] if "=" in value.split("://", 1)[0] else value
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError for a port out of range or not a number
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{value!r}: expected [NAME=]http(s)://host[:port]")
    if port == 0:
        raise argparse.ArgumentTypeError(f"{value!r}: port 0")
    return value


positive_int = int_at_least(1)
seed_arg = int_in(0, 2**32 - 1)
block_size_arg = int_at_least(2, " (the bonus token plus at least one draft; --no-draft for plain decoding)")
temperature_arg = float_in(0.0, 100.0, note=" (0 = greedy)")
top_p_arg = float_in(0.0, 1.0, low_open=True)
min_p_arg = float_in(0.0, 1.0, note=" (0 = off)")


def add_model_args(p, threads_help: str = "torch CPU threads (default: torch's choice)") -> None:
    """--target/--draft, the device and precision flags, --block-size and --threads (generate, demo, serve)."""
    p.add_argument("--target", default=None, help="target model directory or hub id (default: the shipped pair; "
                                                  "with --target, pass --draft too)")
    p.add_argument("--draft", default=None, help="DFlash drafter directory or hub id (default: the shipped pair)")
    p.add_argument("--speculative-config", type=speculative_config_arg, default=None, metavar="JSON",
                   help="vLLM's speculative config: {\"method\": \"dflash\", \"model\": DRAFTER, "
                        "\"num_speculative_tokens\": K, \"disable_by_batch_size\": N} (each key optional) for "
                        "--draft, --block-size K + 1 and --speculative-disable-by-batch-size N")
    add_device_args(p)
    p.add_argument("--block-size", type=block_size_arg, default=None, help="draft block size (default: the drafter's)")
    p.add_argument("--threads", type=positive_int, default=None, help=threads_help)


def add_device_args(p) -> None:
    """--device, --dtype, --draft-dtype, --compile, --pack-weights, --screen-greedy, --exact, --sampler, --noise-thread,
    --cudnn-attention, --draft-policy and --tree-budget (also `flashdraft bench`)."""
    p.add_argument("--device", type=device_arg, default="auto",
                   help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--dtype", type=dtype_arg, default="auto",
                   help="float32, bfloat16, float16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--draft-dtype", type=dtype_arg, default="auto",
                   help="the drafter's dtype (default: the target's; bf16 on a CPU with native bf16)")
    p.add_argument("--compile", action="store_true",
                   help="compile the draft and verify steps (torch.compile; CUDA graphs on GPU); slower start")
    p.add_argument("--pack-weights", choices=("auto", "on", "off"), default="auto",
                   help="CPU: run the wide projections through oneDNN on packed weight copies (auto: when both "
                        "paths, timed on the weights at start-up, favour it and the copies stay under 2 GiB)")
    p.add_argument("--screen-greedy", choices=("auto", "on", "off"), default="auto",
                   help="CPU, fp32 lm_head: greedy verifies (and sampled ones' race under --sampler gumbel, "
                        "without top-k / top-p) read the target's argmax through a bf16 copy of its lm_head, "
                        "certified to be the fp32 argmax (auto: on a CPU with native bf16, AVX512-BF16 or AMX; on: "
                        "an error where it cannot run)")
    p.add_argument("--exact", action="store_true",
                   help="batch-invariant target forward: output bit-identical to plain decoding in --exact mode, "
                        "whatever the block or batch (eager only; costs speed, see BENCHMARKS.md)")
    p.add_argument("--sampler", choices=("gumbel", "rejection"), default="gumbel",
                   help="temperature > 0: gumbel = counter-based noise shared by drafter and target (output equals "
                        "plain decoding's with the same seed; default), rejection = rejection sampling of argmax drafts")
    p.add_argument("--noise-thread", choices=("auto", "on", "off"), default="auto",
                   help="CPU, --sampler gumbel: make sampled rows' noise on a thread of its own while the target "
                        "runs, in cycles where no sampled row drafts (auto: where torch's threads leave a core free)")
    p.add_argument("--cudnn-attention", action="store_true",
                   help="CUDA: let attention take cuDNN's SDPA backend too (left out by default: it plans a graph "
                        "for every new attention shape, and drafting cycles rarely repeat one)")
    p.add_argument("--draft-policy", choices=("adaptive", "fixed"), default="adaptive",
                   help="adaptive = each row verifies the number of drafts that maximises the batch's tokens per "
                        "second under its measured acceptance and the measured step costs (down to one-token steps; "
                        "default); fixed = every row verifies the whole block every cycle")
    p.add_argument("--speculative-disable-by-batch-size", dest="disable_by_batch_size", type=int_at_least(0),
                   default=0, metavar="N",
                   help="batches of more than N requests decode one token per step, as plain decoding (no drafts, "
                        "no lookups, no probes; vLLM's disable_by_batch_size); the draft policy decides below it. "
                        "0 = no limit (default)")
    p.add_argument("--no-confidence-trim", dest="confidence_trim", action="store_false",
                   help="adaptive policy: verify the width planned before the draft, not the width the drafter's "
                        "calibrated confidence in each draft pays for (eager fast path)")
    p.add_argument("--tree-budget", type=tree_budget_arg, default=0,
                   help="token trees: N = each drafting row verifies the N most likely draft nodes (best-first by "
                        "path probability) in one target pass; auto = the size that pays under the measured verify "
                        "cost, per cycle; 0 = the argmax chain (default). Eager fast path only (else the chain)")
    p.add_argument("--lookup-ngram", type=int_in(0, 16), default=0,
                   help="with --tree-budget: add a prompt-lookup branch to every tree, the continuation of the "
                        "latest earlier match of the context's last N tokens (0 = none, default)")
    p.add_argument("--lookup-splice", type=int_in(0, 8), default=4,
                   help="continue a row's chain of drafts by prompt lookup where the context's last N or more tokens "
                        "occurred before and what followed starts with the drafter's first draft (repeats the "
                        "drafter starts and loses; no model call; default 4, 0 = off)")
    p.add_argument("--walk-candidates", type=int_in(0, 1 << 20), default=None, metavar="K",
                   help="DFlash2 drafters whose selector scores every token: each block position walks among its K "
                        "likeliest winners (default 16; 0 = every token, as z-lab's package does; lossless either "
                        "way)")
    p.add_argument("--lookup-steps", type=int_in(0, 8), default=4,
                   help="rows the adaptive policy leaves at one-token steps verify prompt lookup's "
                        "continuation where the context's last N or more tokens occurred before, as far as its "
                        "measured acceptance pays for the wider verify (no model call; eager fast path; default 4, "
                        "0 = off)")


def tree_budget_arg(value: str):
    if value == "auto":
        return value
    try:
        budget = int(value)
    except ValueError:
        budget = -1
    if not 0 <= budget <= 512:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer in [0, 512], got {value!r}")
    return budget


def auto_on_off(args, name: str) -> bool | None:
    """An auto / on / off flag as the engine takes it: None, True, False."""
    return {"auto": None, "on": True, "off": False}[getattr(args, name, "auto")]


def histogram_lines(histogram: list[int], width: int = 40) -> list[str]:
    total = max(1, sum(histogram))
    peak = max(1, max(histogram))
    return [f"{i + 1:>3} | {'#' * round(width * c / peak):<{width}} {c:>5} ({100 * c / total:4.1f}%)"
            for i, c in enumerate(histogram)]


def apply_threads(args) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def load_models(args, no_draft_hint: str = " (or --no-draft for plain decoding)"):
    """(target, tokenizer, drafter or None) for generate / demo: the shipped pair, or --target with --draft, or
    --target / the shipped target with --no-draft. --target alone is refused: it used to mean plain decoding
    silently, although the help promises speculative decoding."""
    from flashdraft.loading import DEFAULT_TARGET, load_pair, load_target

    no_draft = getattr(args, "no_draft", False)
    if no_draft and args.draft:
        raise ValueError("--no-draft and --draft contradict each other")
    if args.target is not None and args.draft is None and not no_draft:
        raise ValueError(f"--target needs --draft{no_draft_hint}")
    if no_draft:
        if args.target is None and not (DEFAULT_TARGET / "config.json").is_file():
            raise DefaultPairMissing(f"no default model shipped yet: {DEFAULT_TARGET} is missing; pass --target")
        model, tokenizer = load_target(args.target or DEFAULT_TARGET, args.device, args.dtype)
        return model, tokenizer, None
    return load_pair(args.target, args.draft, args.device, args.dtype, args.draft_dtype)



def engine_config(args, plain: bool = False):
    """The `EngineConfig` the flags ask for; `plain=True` for the plain-decoding baseline of the same run."""
    from flashdraft.engine import EngineConfig

    config = EngineConfig(block_size=getattr(args, "block_size", None), compile=getattr(args, "compile", False),
                          pack_weights=auto_on_off(args, "pack_weights"),
                          screen_greedy=auto_on_off(args, "screen_greedy"),
                          noise_thread=auto_on_off(args, "noise_thread"),
                          cudnn_attention=getattr(args, "cudnn_attention", False),
                          draft_policy=getattr(args, "draft_policy", "adaptive"),
                          disable_by_batch_size=getattr(args, "disable_by_batch_size", 0),
                          exact=getattr(args, "exact", False), sampler=getattr(args, "sampler", "gumbel"),
                          tree_budget=getattr(args, "tree_budget", 0), lookup_ngram=getattr(args, "lookup_ngram", 0),
                          lookup_splice=getattr(args, "lookup_splice", EngineConfig.lookup_splice),
                          lookup_steps=getattr(args, "lookup_steps", EngineConfig.lookup_steps),
                          confidence_trim=getattr(args, "confidence_trim", EngineConfig.confidence_trim),
                          walk_candidates=getattr(args, "walk_candidates", None),
                          prefix_cache_tokens=getattr(args, "prefix_cache_tokens", 0),
                          mixed_prefill_tokens=_given(args, "mixed_prefill_tokens", EngineConfig.mixed_prefill_tokens))
    return config.plain() if plain else config


def _given(args, name: str, default):
    value = getattr(args, name, None)
    return default if value is None else value


def engine_from_args(args, target, drafter, tokenizer, plain: bool = False):
    """The `SpecEngine` the flags ask for over loaded models (`plain=True`: no drafter, same kernels and mode)."""
    from flashdraft.engine import SpecEngine

    return SpecEngine(target, None if plain else drafter, tokenizer, engine_config(args, plain))


def run_command(args, prog: str = "flashdraft") -> int:
    """Run a parsed subcommand; user errors print one line (exit 2), a missing default pair exits 3."""
    try:
        return int(args.func(args) or 0)
    except DefaultPairMissing as exc:
        print(f"{prog}: {_one_line(exc)}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError) as exc:
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 2


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None):
    """Parsed arguments, or the exit code argparse asked for (2 for a bad flag, 0 for --help)."""
    try:
        return parser.parse_args(argv), None
    except SystemExit as exc:
        return None, exc.code if isinstance(exc.code, int) else 2


def add_structured_args(p: argparse.ArgumentParser) -> None:
    s = p.add_mutually_exclusive_group()
    s.add_argument("--json-schema", metavar="FILE|JSON", help="the output follows this JSON schema")
    s.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    s.add_argument("--regex", help="the whole output matches this regex (Rust regex syntax)")
    s.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)")
    s.add_argument("--grammar", metavar="FILE|LARK", help="the output follows this Lark grammar (llguidance's)")


def structured_output_from_args(args):
    """The `--json-schema` / `--json-object` / `--regex` / `--choice` / `--grammar` constraint, or None."""
    from flashdraft.engine import StructuredOutput

    def text(value):  # a file's contents, or the value itself
        path = Path(value)
        return path.read_text() if len(value) < 4096 and "\n" not in value and path.is_file() else value

    if args.json_schema:
        return StructuredOutput(json_schema=text(args.json_schema))
    if args.json_object or args.regex or args.choice or args.grammar:
        return StructuredOutput(json_object=args.json_object, regex=args.regex, choice=tuple(args.choice or ()),
                                grammar=text(args.grammar) if args.grammar else None)
    return None
