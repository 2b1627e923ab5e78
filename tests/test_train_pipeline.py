"""End-to-end training pipeline on a tiny target: regenerate -> train -> tau with the real engine -> export."""

import json
import os

import pytest
import torch

from flashdraft import DFlashDraftModel, SamplingParams, SpecEngine
from flashdraft.train.data import build_example, encode_prompt, load_examples, record_to_example
from flashdraft.train.evaluate import evaluate_tau
from flashdraft.train.regenerate import regenerate, shard_path
from flashdraft.train.synthetic import BOS, MASK, progression, tiny_target_config, train_tiny_target
from flashdraft.train.trainer import REQUIRED_CONFIG_FIELDS, TrainConfig, Trainer, check_export_config

torch.set_num_threads(1)
MOD = 60


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        a = int(torch.randint(MOD, (1,), generator=g))
        d = (1, 2, 3)[int(torch.randint(3, (1,), generator=g))]
        length = int(torch.randint(3, 8, (1,), generator=g))
        out.append([BOS] + progression(a, d, length, MOD))
    return out


@pytest.fixture(scope="module")
def target():
    """A tiny Qwen3 that continues arithmetic progressions (a few seconds of training on one core)."""
    cfg = tiny_target_config(vocab_size=64, hidden_size=32, intermediate_size=64, heads=2, kv_heads=1, num_layers=4)
    return train_tiny_target(cfg, steps=150, batch_size=16, length=32, lr=5e-3)


@pytest.fixture(scope="module")
def regenerated(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("regen")
    regenerate(target, _prompts(256, 1), out, shard_size=64, batch_size=64, max_new_tokens=40, stop_ids=[0],
               progress=False)
    return out


def test_training_raises_engine_tau_on_held_out_prompts(target, regenerated, tmp_path):
    examples = load_examples(regenerated)
    assert len(examples) == 256
    held_out = _prompts(16, 2)
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), block_size=8, num_draft_layers=2, mask_token_id=MASK,
                      max_steps=400, batch_size=8, num_anchors=16, lr=2e-3, save_every=200, eval_every=200,
                      eval_max_new_tokens=32, progress=False, seed=0)
    result = Trainer(cfg, target_model=target, examples=examples, eval_prompts=held_out).train()
    before, after = result.eval_start["tau"], result.eval_end["tau"]
    print(f"tau before {before:.3f} after {after:.3f}; tokens/s {result.tokens_per_second:.0f}")
    assert after > before + 1.5 and after > 3.0, f"tau before training {before:.3f}, after {after:.3f}"
    assert result.losses[-1] < 0.5 * result.losses[0], (result.losses[0], result.losses[-1])
    # per-position acceptance comes out of the engine and decreases with depth overall
    ppa = result.eval_end["per_position_acceptance"]
    assert len(ppa) == 7 and ppa[0] >= ppa[-1] > 0
    log = [json.loads(line) for line in open(tmp_path / "run" / "train_log.jsonl")]
    steps = [r for r in log if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 401))
    assert all({"loss", "lr", "tokens_per_s", "grad_norm", "acc_per_position"} <= set(r) for r in steps)
    evals = [r for r in log if r.get("event") == "eval"]
    assert [e["step"] for e in evals] == [0, 200, 400] and evals[-1]["tau"] == after
    # the exported drafter is complete, loads with from_pretrained and measures the same tau in a fresh engine
    final = tmp_path / "run" / "final"
    assert check_export_config(final) == []
    loaded = DFlashDraftModel.from_pretrained(final)
    again = evaluate_tau(target, loaded, held_out, 32)
    assert abs(again["tau"] - after) < 1e-6
    # and decoding with it stays lossless (greedy output == the target's own)
    base = SpecEngine(target).generate(held_out[:4], SamplingParams(max_new_tokens=24))
    spec = SpecEngine(target, loaded).generate(held_out[:4], SamplingParams(max_new_tokens=24))
    assert [r.token_ids for r in base] == [r.token_ids for r in spec]


def test_exported_config_has_every_loader_field(target, tmp_path):
    examples = [build_example([BOS] + progression(i, 1, 4, MOD), progression(i + 4, 1, 20, MOD)) for i in range(8)]
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), block_size=16, num_draft_layers=1, mask_token_id=MASK,
                      max_steps=1, batch_size=4, num_anchors=4, progress=False, target_layer_ids=[0, 2])
    Trainer(cfg, target_model=target, examples=examples).train()
    conf = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    for key in REQUIRED_CONFIG_FIELDS:
        assert key in conf, key
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["model_type"] == "qwen3"
    assert conf["block_size"] == 16 and conf["num_target_layers"] == 4
    assert conf["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [0, 2], "block_size": 16}
    assert conf["hidden_size"] == 32 and conf["vocab_size"] == 64 and conf["layer_types"] == ["full_attention"]
    assert "rope_parameters" in conf or "rope_theta" in conf
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "run" / "final" / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"} <= keys
    assert not any(k.startswith(("model.", "embed", "lm_head")) for k in keys)


def test_regenerate_is_sharded_and_resumable(target, tmp_path):
    prompts = _prompts(10, 5)
    out = tmp_path / "regen"
    paths = regenerate(target, prompts, out, shard_size=4, batch_size=3, max_new_tokens=8, progress=False)
    assert [p.name for p in paths] == ["shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    first = [json.loads(line) for line in open(paths[0])]
    assert [r["index"] for r in first] == [0, 1, 2, 3] and first[1]["prompt_ids"] == prompts[1]
    assert len(first[0]["response_ids"]) == 8
    base = SpecEngine(target).generate([prompts[1]], SamplingParams(max_new_tokens=8))[0].token_ids
    assert first[1]["response_ids"] == base  # greedy regeneration is the target's own output
    # a kill mid-shard leaves only a .tmp: the rerun redoes that shard and skips the complete ones
    content = paths[1].read_text()
    paths[1].unlink()
    shard_path(out, 1).with_suffix(".jsonl.tmp").write_text('{"partial"')
    mtime0 = os.stat(paths[0]).st_mtime_ns
    regenerate(target, prompts, out, shard_size=4, batch_size=3, max_new_tokens=8, progress=False)
    assert paths[1].read_text() == content and os.stat(paths[0]).st_mtime_ns == mtime0
    # sampled regeneration is reproducible per prompt (seeded by index)
    s1 = regenerate(target, prompts[:4], tmp_path / "s1", shard_size=4, max_new_tokens=6, temperature=1.0, seed=3,
                    progress=False)
    s2 = regenerate(target, prompts[:4], tmp_path / "s2", shard_size=4, max_new_tokens=6, temperature=1.0, seed=3,
                    progress=False)
    assert s1[0].read_text() == s2[0].read_text()
    assert len(load_examples(out)) == 10


def test_feature_cache_matches_online_features(target, tmp_path):
    examples = [build_example([BOS] + progression(i, 2, 5, MOD), progression(i + 10, 2, 20, MOD)) for i in range(8)]
    losses = []
    for cache in (None, str(tmp_path / "cache")):
        cfg = TrainConfig(output_dir=str(tmp_path / f"run{cache is None}"), block_size=4, num_draft_layers=1,
                          mask_token_id=MASK, max_steps=3, batch_size=4, num_anchors=8, progress=False,
                          feature_cache=cache)
        losses.append(Trainer(cfg, target_model=target, examples=examples).train().losses)
    assert (tmp_path / "cache" / "features-00000.safetensors").exists()
    assert torch.allclose(torch.tensor(losses[0]), torch.tensor(losses[1]), atol=1e-5), losses


def test_data_records_and_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(__file__), "..", "flashdraft", "assets",
                                                     "default_pair", "target"))
    # plain prompt/response
    ex = record_to_example({"prompt": "hello", "response": " world"}, tok, eos_token_id=tok.eos_token_id)
    p = encode_prompt({"prompt": "hello"}, tok)
    assert ex.input_ids[: len(p)].tolist() == p and not ex.loss_mask[: len(p)].any() and ex.loss_mask[len(p):].all()
    assert ex.input_ids[-1] == tok.eos_token_id
    # chat template: loss only on the assistant turn
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    rec = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    ex = record_to_example(rec, tok)
    prompt = encode_prompt(rec, tok)
    assert tok.decode(prompt) == "<|user|>2+2?\n<|assistant|>"
    assert ex.input_ids[: len(prompt)].tolist() == prompt and int(ex.loss_mask.sum()) == len(ex) - len(prompt)
    assert tok.decode(ex.input_ids[ex.loss_mask]).strip() == "4"
    # pre-tokenized and regenerated records, truncation
    ex = record_to_example({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}, max_length=3)
    assert ex.input_ids.tolist() == [1, 2, 3] and ex.loss_mask.tolist() == [False, False, True]
    ex = record_to_example({"prompt_ids": [5, 6], "response_ids": [7]})
    assert ex.loss_mask.tolist() == [False, False, True]


def _mixture_by_hand(logits, labels, weights, teacher, alpha, temperature, normaliser):
    """sum_slots w * ((1 - alpha) * CE(label) + alpha * T^2 * KL(softmax(teacher / T) || softmax(logits / T))) /
    normaliser, written out from the definitions (float64)."""
    logits, teacher, w = logits.double(), teacher.double(), weights.double()
    log_z = logits.exp().sum(-1).log()
    ce = log_z - logits.gather(-1, labels[..., None])[..., 0]
    p_t = (teacher / temperature).exp() / (teacher / temperature).exp().sum(-1, keepdim=True)
    p_d = (logits / temperature).exp() / (logits / temperature).exp().sum(-1, keepdim=True)
    kl = (p_t * (p_t.log() - p_d.log())).sum(-1) * temperature ** 2
    return float(((1 - alpha) * ce + alpha * kl).mul(w).sum() / normaliser), float(kl.mul(w).sum())


def test_distillation_and_long_prompts(target, tmp_path, monkeypatch):
    import flashdraft.train.trainer as trainer_module

    calls = []
    real_loss = trainer_module.dflash_loss

    def recording_loss(hidden, logits_fn, labels, weights, *args, **kw):
        out = real_loss(hidden, logits_fn, labels, weights, *args, **kw)
        sel = weights > 0
        with torch.no_grad():  # the drafter's logits for the labelled slots, with the weights of this step
            logits = logits_fn(hidden[sel]).float()
        calls.append(dict(kw, logits=logits, labels=labels[sel], weights=weights[sel], loss=float(out.loss.detach()),
                          teacher=kw["teacher_logits"][sel].float()))
        return out

    monkeypatch.setattr(trainer_module, "dflash_loss", recording_loss)
    examples = [build_example([BOS] + progression(i, 1, 5, MOD), progression(i + 5, 1, 20, MOD)) for i in range(8)]
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), block_size=4, num_draft_layers=1, mask_token_id=MASK,
                      max_steps=2, batch_size=4, num_anchors=8, progress=False, distill_weight=0.3,
                      distill_temperature=2.0)
    res = Trainer(cfg, target_model=target, examples=examples).train()
    assert len(res.losses) == 2 and len(calls) == 2
    for c, logged in zip(calls, res.losses):
        assert c["distill_weight"] == 0.3 and c["temperature"] == 2.0
        # the teacher is the target's prediction of each slot's label (this target continues progressions): the
        # logits at position p - 1, not p (that would predict the token after the label)
        agree = (c["teacher"].argmax(-1) == c["labels"]).float().mean()
        assert agree > 0.9, float(agree)
        want, kl = _mixture_by_hand(c["logits"], c["labels"], c["weights"], c["teacher"], 0.3, 2.0, c["normaliser"])
        assert kl > 0.1  # an untrained drafter disagrees with the teacher: the KL term is really in the loss
        assert abs(c["loss"] - want) < 1e-4 * max(1.0, want), (c["loss"], want)
        assert abs(logged - want) < 1e-4 * max(1.0, want), (logged, want)  # the loss the trainer reports
    # regeneration stops at the target's context (256 positions) instead of failing
    long = [[BOS] + progression(0, 1, 250, MOD), [BOS] + progression(0, 1, 300, MOD)]
    (path,) = regenerate(target, long, tmp_path / "regen", max_new_tokens=20, progress=False, stop_ids=[])
    recs = [json.loads(line) for line in open(path)]
    assert len(recs[0]["response_ids"]) == 5 and recs[1]["finish_reason"] == "prompt_too_long"


def test_distillation_loss_is_the_documented_mixture_and_pulls_toward_the_teacher():
    from flashdraft.train.loss import dflash_loss

    g = torch.Generator().manual_seed(0)
    b, q, v, block = 2, 8, 7, 4
    student = torch.randn(b, q, v, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(b, q, v, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(v, (b, q), generator=g)
    offset = torch.arange(block).repeat(q // block)[None].expand(b, q)
    weights = torch.where(offset > 0, torch.rand(b, q, generator=g, dtype=torch.float64) + 0.5, torch.zeros(()))
    identity = lambda h: h  # noqa: E731  (the "hidden states" are the student's logits)
    for alpha, temp in ((0.3, 1.0), (0.5, 2.0), (1.0, 0.5)):
        out = dflash_loss(student, identity, labels, weights, offset, block, teacher_logits=teacher,
                          distill_weight=alpha, temperature=temp)
        sel = weights > 0
        want, _ = _mixture_by_hand(student[sel].detach(), labels[sel], weights[sel], teacher[sel], alpha, temp,
                                   float(weights.sum()))
        assert abs(out.loss.item() - want) < 1e-5, (alpha, temp, out.loss.item(), want)
    # teacher == student: the KL term vanishes, pure distillation is exactly 0 and the mixture is (1 - alpha) * CE
    same = student.detach().clone()
    assert abs(dflash_loss(student, identity, labels, weights, offset, block, teacher_logits=same,
                           distill_weight=1.0, temperature=2.0).loss.item()) < 1e-6
    ce = dflash_loss(student, identity, labels, weights, offset, block).loss.item()
    mixed = dflash_loss(student, identity, labels, weights, offset, block, teacher_logits=same,
                        distill_weight=0.25).loss.item()
    assert abs(mixed - 0.75 * ce) < 1e-6
    # pure distillation, T = 1: the gradient on the student's logits is w * (p_student - p_teacher) / sum(w), so a
    # gradient step moves the student's distribution toward the teacher's (KL strictly decreases at every slot)
    out = dflash_loss(student, identity, labels, weights, offset, block, teacher_logits=teacher, distill_weight=1.0)
    (grad,) = torch.autograd.grad(out.loss, student)
    p_s, p_t = torch.softmax(student.detach(), -1), torch.softmax(teacher, -1)
    assert torch.allclose(grad, weights[..., None] * (p_s - p_t) / weights.sum(), atol=1e-6)
    stepped = student.detach() - 0.5 * grad / grad.abs().max()

    def kl(s):
        return (p_t * (p_t.log() - torch.log_softmax(s, -1))).sum(-1)

    sel = weights > 0
    assert bool((kl(stepped)[sel] < kl(student.detach())[sel]).all())
