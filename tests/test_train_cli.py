"""The `regenerate` and `train` subcommands end to end on a tiny target with the bundled tokenizer (text prompts)."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from flashdraft.train.cli import main
from flashdraft.train.synthetic import tiny_target_config
from flashdraft.train.trainer import check_export_config

torch.set_num_threads(1)
TOKENIZER = Path(__file__).resolve().parent.parent / "flashdraft" / "assets" / "default_pair" / "target"


def test_cli_regenerate_then_train_uses_tokenizer_mask_token(tmp_path):
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    assert tok.mask_token_id is not None
    torch.manual_seed(0)
    cfg = tiny_target_config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, heads=2, kv_heads=1)
    cfg.eos_token_id = tok.eos_token_id
    target = tmp_path / "target"
    Qwen3ForCausalLM(cfg).save_pretrained(target)
    for f in TOKENIZER.glob("tokenizer*.json"):
        shutil.copy(f, target / f.name)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Count from {i}:"}) + "\n" for i in range(6)))
    regen = tmp_path / "regen"
    assert main(["regenerate", "--target", str(target), "--data", str(prompts), "--output-dir", str(regen),
                 "--shard-size", "4", "--max-new-tokens", "12", "--no-progress", "--device", "cpu"]) == 0
    records = [json.loads(line) for f in sorted(regen.glob("shard-*.jsonl")) for line in open(f)]
    assert len(records) == 6 and all("response_text" in r for r in records)
    assert records[0]["prompt_ids"] == tok("Count from 0:")["input_ids"]
    shaped = tmp_path / "regen_regex"  # answers under a grammar: a drafter for structured traffic
    assert main(["regenerate", "--target", str(target), "--data", str(prompts), "--output-dir", str(shaped),
                 "--max-new-tokens", "12", "--no-progress", "--device", "cpu",
                 "--regex", "[0-9]{1,3}(, [0-9]{1,3})*"]) == 0
    texts = [json.loads(line)["response_text"] for f in sorted(shaped.glob("shard-*.jsonl")) for line in open(f)]
    assert len(texts) == 6 and all(re.fullmatch(r"[0-9]{1,3}(, [0-9]{1,3})*,?( [0-9]{0,3})?", t) for t in texts), texts
    out = tmp_path / "run"
    assert main(["train", "--target", str(target), "--data", str(regen), "--output-dir", str(out),
                 "--block-size", "4", "--num-draft-layers", "1", "--max-steps", "2", "--batch-size", "2",
                 "--num-anchors", "3", "--start-anchors", "2", "--eval-prompts", str(prompts), "--eval-limit", "2",
                 "--eval-max-new-tokens", "8", "--no-progress", "--device", "cpu"]) == 0
    conf = json.loads((out / "final" / "config.json").read_text())
    assert conf["dflash_config"]["mask_token_id"] == tok.mask_token_id
    assert check_export_config(out / "final") == []
    assert json.loads(open(out / "train_log.jsonl").readline())["config"]["start_anchors"] == 2
    evals = [json.loads(line) for line in open(out / "train_log.jsonl") if '"eval"' in line]
    assert [e["step"] for e in evals] == [0, 2] and all(e["num_cycles"] > 0 for e in evals)


def test_train_without_mask_token_fails_clearly(tmp_path):
    torch.manual_seed(0)
    target = tmp_path / "target"
    Qwen3ForCausalLM(tiny_target_config()).save_pretrained(target)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input_ids": list(range(4, 30))}) + "\n")
    with pytest.raises(ValueError, match="--mask-token-id"):
        main(["train", "--target", str(target), "--data", str(data), "--output-dir", str(tmp_path / "o"),
              "--device", "cpu", "--no-progress"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention training runs on GPU only)")
def test_flex_training_on_gpu_matches_sdpa(tmp_path):
    from flashdraft.train.synthetic import BOS, MASK, progression
    from flashdraft.train.data import build_example
    from flashdraft.train.trainer import TrainConfig, Trainer

    examples = [build_example([BOS] + progression(i, 1, 5, 60), progression(i + 5, 1, 40, 60)) for i in range(8)]
    losses = {}
    for kind in ("sdpa", "flex"):
        torch.manual_seed(0)
        target = Qwen3ForCausalLM(tiny_target_config()).cuda()
        cfg = TrainConfig(output_dir=str(tmp_path / kind), block_size=8, num_draft_layers=1, mask_token_id=MASK,
                          max_steps=3, batch_size=4, num_anchors=8, progress=False, attention=kind, device="cuda")
        trainer = Trainer(cfg, target_model=target, examples=examples)
        assert trainer.attention == kind
        losses[kind] = trainer.train().losses
    assert torch.allclose(torch.tensor(losses["sdpa"]), torch.tensor(losses["flex"]), atol=2e-2), losses
