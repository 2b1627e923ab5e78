"""Reduced draft vocabulary (`flashdraft/model/draft_vocab.py`): which ids are kept, the EAGLE-3 `d2t` layout it
exports (read back by our loader, as vLLM reads it), drafting over it (an id outside is never drafted), losslessness
against the target's own generate (greedy) and seeded plain decoding (sampled), and `flashdraft train
--draft-vocab-size / --init-from`."""

import json

import pytest
import torch
from safetensors.torch import load_file

from flashdraft import DFlashDraftModel, SamplingParams, SpecEngine
from flashdraft.model.draft_vocab import (copy_weights, count_tokens, d2t_offsets, draft_targets, restrict_drafter,
                                          select_draft_vocab)
from tiny import MASK_ID, VOCAB, greedy_reference, make_drafter, make_target

torch.set_num_threads(1)
PROMPTS = [[3, 4, 5, 6], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [40, 7]]


def test_select_draft_vocab_keeps_the_most_frequent_ids_in_order():
    counts = count_tokens([torch.tensor([5, 5, 5, 2, 2, 9, 9, 7])], 12)
    assert counts.tolist() == [0, 0, 2, 0, 0, 3, 0, 1, 0, 2, 0, 0]
    ids = select_draft_vocab(counts, 3)  # 5 (3 times), then 2 and 9 (twice each) before 7
    assert ids.tolist() == [2, 5, 9]
    assert select_draft_vocab(counts, 4).tolist() == [2, 5, 7, 9]
    assert select_draft_vocab(counts, 5).tolist() == [0, 2, 5, 7, 9]  # ties at zero: the lowest id
    d2t = d2t_offsets(ids)
    assert d2t.tolist() == [2, 4, 7] and draft_targets(d2t).tolist() == [2, 5, 9]
    with pytest.raises(ValueError, match="draft vocabulary size"):
        select_draft_vocab(counts, 13)


@pytest.fixture(scope="module")
def pair():
    target = make_target()
    return target, make_drafter(target, block_size=4)


def _kept(target, size=VOCAB // 2):
    """The ids of the target's own greedy outputs, most frequent first (how training chooses them)."""
    outs = [greedy_reference(target, p, 24) for p in PROMPTS]
    return select_draft_vocab(count_tokens([torch.tensor(o) for o in outs], VOCAB), size)


def test_restricted_drafter_is_the_old_one_inside_its_vocabulary(pair):
    target, drafter = pair
    kept = _kept(target)
    small = restrict_drafter(drafter, target.get_output_embeddings().weight, kept)
    assert small.lm_head.weight.shape == (kept.numel(), drafter.config.hidden_size)
    h = torch.randn(2, 3, drafter.config.hidden_size, dtype=torch.float64)
    full = drafter.compute_logits(h, target.get_output_embeddings())
    part = small.compute_logits(h, target.get_output_embeddings())
    torch.testing.assert_close(part[..., kept], full[..., kept])
    outside = torch.ones(VOCAB, dtype=torch.bool).index_fill(0, kept, False)
    assert torch.isinf(part[..., outside]).all() and (part[..., outside] < 0).all()


def _recording(engine) -> list:
    """Every draft the engine's proposer makes from now on."""
    drafts, propose = [], engine.proposer.propose

    def record(state, inp, block_size):
        out = propose(state, inp, block_size)
        drafts.append(out[0].clone())
        return out

    engine.proposer.propose = record
    return drafts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_reduced_vocabulary_drafts_inside_it_and_stays_lossless(pair, temperature):
    target, drafter = pair
    greedy_ids = {t for p in PROMPTS for t in greedy_reference(target, p, 24)}
    kept = _kept(target, size=len(greedy_ids) // 2)  # half of what greedy decoding emits
    small = restrict_drafter(drafter, target.get_output_embeddings().weight, kept)
    engine = SpecEngine(target, small, draft_policy="fixed")  # every cycle drafts, whatever the timing
    drafts = _recording(engine)
    params = SamplingParams(max_new_tokens=24, temperature=temperature, seed=5 if temperature else None)
    outs = engine.generate(PROMPTS, params)
    drafted = torch.cat([d.flatten() for d in drafts])
    assert drafted.numel() > 0 and set(drafted.tolist()) <= set(kept.tolist())
    if temperature == 0:  # the target's own transformers generate, token for token
        assert [o.token_ids for o in outs] == [greedy_reference(target, p, 24) for p in PROMPTS]
    else:  # seeded sampling: exactly the text plain decoding samples with the same seed
        plain = SpecEngine(target).generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    # tokens outside the draft vocabulary were generated (so the test covers them) and cost only a rejection
    generated = {t for o in outs for t in o.token_ids}
    assert generated - set(kept.tolist())


def test_export_is_the_eagle3_layout_and_loads_back(pair, tmp_path):
    target, drafter = pair
    kept = _kept(target)
    small = restrict_drafter(drafter, target.get_output_embeddings().weight, kept)
    small.save_pretrained(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["draft_vocab_size"] == kept.numel() and config["vocab_size"] == VOCAB
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert state["d2t"].dtype == torch.int64 and torch.equal(state["d2t"] + torch.arange(kept.numel()), kept)
    assert state["lm_head.weight"].shape == (kept.numel(), drafter.config.hidden_size)
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "d")
    h = torch.randn(1, 2, drafter.config.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(loaded.compute_logits(h, None), small.compute_logits(h, None))


def test_train_with_draft_vocab_size_and_init_from(pair, tmp_path):
    from flashdraft.train.data import build_example
    from flashdraft.train.trainer import TrainConfig, Trainer

    target, drafter = pair
    drafter.save_pretrained(tmp_path / "init")
    examples = [build_example(p, greedy_reference(target, p, 24)) for p in PROMPTS * 2]
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), block_size=4, num_draft_layers=2, mask_token_id=MASK_ID,
                      max_steps=2, batch_size=4, num_anchors=4, progress=False, draft_vocab_size=20,
                      init_from=str(tmp_path / "init"), lr=0.0)
    trainer = Trainer(cfg, target_model=target, examples=examples)
    kept = draft_targets(trainer.drafter.d2t)
    responses = torch.cat([e.input_ids[e.loss_mask] for e in examples])
    assert torch.equal(kept, select_draft_vocab(count_tokens([responses], VOCAB), 20))
    # started from the given drafter; the read-out = the target's rows of the kept ids
    start = restrict_drafter(drafter, target.get_output_embeddings().weight, kept)
    for name, tensor in start.state_dict().items():
        torch.testing.assert_close(trainer.drafter.state_dict()[name].to(tensor.dtype), tensor, msg=name)
    result = trainer.train()
    assert all(torch.isfinite(torch.tensor(result.losses)))
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "run" / "final")
    assert torch.equal(draft_targets(loaded.d2t), kept)
    with pytest.raises(ValueError, match="init_from|cannot initialise"):
        copy_weights(make_drafter(target, num_layers=1), trainer.drafter)


def test_restrict_vocab_script_saves_a_drafter_that_drafts_inside_its_vocabulary(tmp_path):
    """scripts/drafter/restrict_vocab.py on a saved pair and regenerated data: the saved drafter reads out over the
    N most frequent response ids (d2t), loads back, and greedy output through it equals the target's."""
    import importlib.util
    from pathlib import Path

    from flashdraft.loading import load_pair
    from tiny import save_text_pair

    save_text_pair(tmp_path, block_size=4)
    data = tmp_path / "regen"
    data.mkdir()
    responses = [[30, 31, 32, 30, 31], [30, 40, 41], [30, 31, 50]]
    (data / "shard-00000.jsonl").write_text("".join(
        json.dumps({"index": i, "prompt_ids": [5, 6, 7], "response_ids": r}) + "\n" for i, r in enumerate(responses)))
    script = Path(__file__).resolve().parents[1] / "scripts" / "drafter" / "restrict_vocab.py"
    spec = importlib.util.spec_from_file_location("restrict_vocab", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "small"
    assert module.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "drafter"),
                        "--vocab-data", str(data), "--size", "3", "--out", str(out)]) == 0
    target, _, small = load_pair(tmp_path / "target", out, "cpu")
    assert draft_targets(small.d2t).tolist() == [30, 31, 32]  # 30 x4, 31 x3, then the lowest of the singles
    torch.testing.assert_close(small.lm_head.weight, target.get_output_embeddings().weight[[30, 31, 32]].to(
        small.lm_head.weight.dtype))
    engine = SpecEngine(target, small, draft_policy="fixed")
    prompt = [5, 6, 7, 8]
    out_ids = engine.generate([prompt], SamplingParams(max_new_tokens=12))[0].token_ids
    assert out_ids == greedy_reference(target, prompt, 12)
    with pytest.raises(SystemExit):
        module.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "drafter"),
                     "--vocab-data", str(data), "--size", str(VOCAB * 1000), "--out", str(tmp_path / "bad")])
