"""A Phi-4-mini-shaped tiny LongRoPE pair for `flashdraft demo` (kept as run): a random target (hidden 128, 4 layers,
3/4 of each head rotary, LongRoPE with original length 160, the shipped tokenizer) and a random DFlash drafter for it,
so that the demo's held-out prompts (13-51 tokens) plus 160 new tokens cross the original length:

    python docs/bench/fast_families/longrope_demo_pair.py /tmp/phi4tiny
    flashdraft demo --target /tmp/phi4tiny/target --draft /tmp/phi4tiny/drafter --draft-policy fixed \\
        --max-new-tokens 160 --threads 2

The demo checks every output against the target's own greedy `generate` (the drafter is untrained: tau ~1)."""
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, Phi3Config, Phi3ForCausalLM

from flashdraft.model.drafter import DFlashDraftModel, make_draft_config

out = Path(sys.argv[1])
tok = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[3] / "flashdraft/assets/default_pair/target")
torch.manual_seed(0)
cfg = Phi3Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096, partial_rotary_factor=0.75, initializer_range=0.1,
                 original_max_position_embeddings=160, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 12,
                                  "long_factor": [1.0 + i for i in range(12)]},
                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
shutil.rmtree(out, ignore_errors=True)
Phi3ForCausalLM(cfg).save_pretrained(out / "target")
tok.save_pretrained(out / "target")
DFlashDraftModel(make_draft_config(cfg, num_layers=1, block_size=8, mask_token_id=tok.mask_token_id)).save_pretrained(
    out / "drafter")
print(f"saved {out}/target and {out}/drafter")
