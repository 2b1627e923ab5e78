"""Byte-level BPE tokenizer for the shipped default target.

Trains a byte-level BPE (``tokenizers`` library, vocab 8192 including the special
tokens) on the train split of the stdlib corpus and saves it as a transformers
``PreTrainedTokenizerFast`` into ``flashdraft/assets/default_pair/target/``, so that
``AutoTokenizer.from_pretrained(dir)`` works.

Special tokens (fixed ids):
  * ``<|endoftext|>`` id 0 -- eos; also used as bos and pad.
  * ``<|mask|>``      id 1 -- the dedicated DFlash mask token.

The tokenizer is saved with ``split_special_tokens=True``: special-token strings that
appear in ordinary text are tokenized as plain bytes, so neither id can come out of
encoding normal text; they are only ever inserted by id. No bos is prepended and no
chat template is set (it is a code-completion model).

Usage (from the repository root)::

    python scripts/default_pair/tokenizer.py [--force] [--vocab-size 8192]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.default_pair.corpus import load_corpus  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "flashdraft" / "assets" / "default_pair" / "target"
EOS = "<|endoftext|>"
MASK = "<|mask|>"
SPECIALS = [EOS, MASK]


def train_tokenizer(vocab_size: int = 8192, min_frequency: int = 2):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())  # byte-level: every byte is in the alphabet, no unk needed
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIALS,  # ids 0, 1 in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    docs = load_corpus("train")
    tok.train_from_iterator((d["text"] for d in docs), trainer=trainer, length=len(docs))
    return tok


def to_transformers(tok):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=EOS,
        mask_token=MASK,
        model_max_length=2048,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        split_special_tokens=True,
    )
    return hf


def check(out_dir: Path) -> dict:
    """Loads with AutoTokenizer and checks ids, round trips and the special-token guarantee."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # whole files exceed model_max_length; that is fine here
    t = AutoTokenizer.from_pretrained(out_dir)
    assert t.eos_token_id == 0 and t.pad_token_id == 0 and t.bos_token_id == 0, t.special_tokens_map
    assert t.mask_token_id == 1, t.mask_token_id
    assert t.convert_tokens_to_ids(MASK) == 1
    docs = load_corpus("heldout")
    n_tok = n_bytes = 0
    for d in docs:
        ids = t(d["text"], add_special_tokens=True)["input_ids"]
        assert 0 not in ids and 1 not in ids, d["path"]
        assert t.decode(ids) == d["text"], f"round trip failed for {d['path']}"
        n_tok += len(ids)
        n_bytes += len(d["text"].encode("utf-8"))
    tricky = f"x = '{EOS}' + \"{MASK}\"\n"
    ids = t(tricky)["input_ids"]
    assert 0 not in ids and 1 not in ids, "special-token text must not map to special ids"
    assert t.decode(ids) == tricky
    return {"heldout_tokens": n_tok, "heldout_bytes": n_bytes, "bytes_per_token": n_bytes / n_tok}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Train the default-pair byte-level BPE tokenizer")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--min-frequency", type=int, default=2)
    ap.add_argument("--force", action="store_true", help="retrain even if the tokenizer exists")
    args = ap.parse_args(argv)

    if (args.out / "tokenizer.json").exists() and not args.force:
        print(f"[tokenizer] exists: {args.out}/tokenizer.json, use --force to retrain")
    else:
        t0 = time.time()
        tok = train_tokenizer(args.vocab_size, args.min_frequency)
        hf = to_transformers(tok)
        args.out.mkdir(parents=True, exist_ok=True)
        hf.save_pretrained(args.out)
        print(f"[tokenizer] trained vocab={tok.get_vocab_size()} in {time.time() - t0:.1f}s -> {args.out}")
    stats = check(args.out)
    print(f"[tokenizer] ok: {json.dumps(stats)}")


if __name__ == "__main__":
    sys.exit(main())
