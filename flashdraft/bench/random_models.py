"""Tiny randomly initialised models for trying `flashdraft bench` without a trained pair (format and checks only:
a random drafter accepts almost nothing, so speculative methods are slower than plain decoding on these).

    python -m flashdraft.bench.random_models /tmp/benchpair     # target/, drafter/, assistant/, prompts.jsonl

The target is a 2.9M-parameter Qwen3 with the project's tokenizer (its logits sharpened x4 so greedy outputs
avoid near-ties), the drafter a 1-layer DFlash drafter (block 8), the assistant a 0.3M-parameter Qwen3.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

PROMPTS = ["def fibonacci(n):\n", "import os\n\ndef list_files(path):\n", "class Stack:\n    def __init__(self):\n",
           "def quicksort(items):\n", "def parse_args(argv):\n", "with open(path) as f:\n"]


def make_random_models(root: str | Path) -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from flashdraft import DFlashDraftModel, make_draft_config
    from flashdraft.loading import DEFAULT_TARGET

    root = Path(root)
    tok = AutoTokenizer.from_pretrained(DEFAULT_TARGET)
    common = dict(vocab_size=len(tok), max_position_embeddings=1024, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, **common)
    target = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    target.save_pretrained(root / "target")
    for f in DEFAULT_TARGET.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, root / "target" / f.name)
    torch.manual_seed(1)
    DFlashDraftModel(make_draft_config(cfg, num_layers=1, block_size=8, mask_token_id=tok.mask_token_id)
                     ).save_pretrained(root / "drafter")
    torch.manual_seed(2)
    Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, **common)
                     ).save_pretrained(root / "assistant")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root


if __name__ == "__main__":
    print(make_random_models(sys.argv[1] if len(sys.argv) > 1 else "/tmp/benchpair"))
