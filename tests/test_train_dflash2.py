"""Training DFlash2 drafters (`flashdraft train --arch dflash2`): the training pass (many blocks of a sequence in one
forward, the convolutions restarting at every block) gives each block the hidden states decoding gives it; the
selector's loss is teacher-forced and trains the pair term only; a short CPU run trains convolutions and selector,
exports z-lab's layout, and drafts losslessly in our engine."""

import json

import pytest
import torch
from safetensors.torch import load_file

from flashdraft import SamplingParams, SpecEngine
from flashdraft.loading import load_drafter
from flashdraft.model import DFlash2DraftModel, make_dflash2_config
from flashdraft.train.data import Example
from flashdraft.train.masks import training_mask
from flashdraft.train.selector import previous_tokens, selector_loss
from flashdraft.train.synthetic import BOS, MASK, progression
from flashdraft.train.trainer import TrainConfig, Trainer, check_config
from training_pass import assert_blocks_decode_as_trained, one_sequence, tiny_target

torch.set_num_threads(1)


def _drafter(target, block=4):
    torch.manual_seed(1)
    drafter = DFlash2DraftModel(make_dflash2_config(target.config, num_layers=2, block_size=block, mask_token_id=MASK,
                                                    selector_rank=4, selector_top_k=4, conv_kernel_size=3,
                                                    conv_group_size=8))
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.normal_(0, 0.5)
                conv.kernel_projection.weight.normal_(0, 0.3)
    return drafter


def test_training_pass_equals_decoding_per_block():
    target = tiny_target().double()
    drafter = _drafter(target).double().eval()
    block = 4
    seq = one_sequence(drafter, target, 40, [3, 11, 20, 33], block)
    mask = training_mask("sdpa", seq.anchors, seq.valid, block, False)
    with torch.no_grad():
        trained = drafter(seq.noise, seq.position_ids, seq.feats, seq.ctx_pos, seq.valid, mask)
        assert_blocks_decode_as_trained(drafter, seq, trained, block)


def test_selector_loss_is_teacher_forced_and_trains_the_pair_term():
    block_ids = torch.tensor([[7, MASK, MASK, MASK, 9, MASK, MASK, MASK]])
    labels = torch.tensor([[0, 11, 12, 13, 0, 21, 22, 23]])
    offset = torch.arange(4).repeat(2)[None]
    prev = previous_tokens(block_ids, labels, offset)
    assert prev[0, [1, 2, 3, 5, 6, 7]].tolist() == [7, 11, 12, 9, 21, 22]
    target = tiny_target()
    drafter = _drafter(target)
    hidden = torch.randn(1, 8, 32, requires_grad=True)
    weights = (offset > 0).float()
    marginal = torch.nn.Linear(32, 64, bias=False)
    with torch.no_grad():  # every label among the top 4 of the marginal
        marginal.weight.mul_(0.01)
        marginal.weight[[11, 12, 13, 21, 22, 23]] += 1.0
    out = selector_loss(drafter, hidden, marginal, block_ids, labels, weights, offset, normaliser=weights.sum())
    out.loss.backward()
    assert out.loss > 0 and out.count == 6
    selector = drafter.candidate_selector
    assert selector.predecessor_codebook.weight.grad[[7, 11, 12, 9, 21, 22]].abs().sum() > 0
    assert selector.predecessor_codebook.weight.grad[[13, 23]].abs().sum() == 0  # no slot follows them
    assert marginal.weight.grad is None and hidden.grad.abs().sum() > 0  # the marginal's logits enter detached


@pytest.mark.parametrize("top_k", [4, 64])
def test_the_selectors_soft_labels_are_the_targets_distribution_over_its_candidates(top_k):
    """`distill_weight` 1: the loss is KL(target || selector) over the candidates (the target renormalised over a
    top-k, the whole distribution when every token is a candidate), weighted per slot like the cross-entropy; 0.5
    mixes the two halves; the soft term alone still trains the selector."""
    import torch.nn.functional as F

    block_ids = torch.tensor([[7, MASK, MASK, MASK, 9, MASK, MASK, MASK]])
    labels = torch.tensor([[0, 11, 12, 13, 0, 21, 22, 23]])
    offset = torch.arange(4).repeat(2)[None]
    target = tiny_target()
    torch.manual_seed(1)
    drafter = DFlash2DraftModel(make_dflash2_config(target.config, num_layers=2, block_size=4, mask_token_id=MASK,
                                                    selector_rank=4, selector_top_k=top_k, conv_kernel_size=3,
                                                    conv_group_size=8))
    selector = drafter.candidate_selector
    assert selector.whole_vocabulary == (top_k == 64)
    hidden = torch.randn(1, 8, 32)
    weights = torch.tensor([[0.0, 1.0, 0.5, 0.25, 0.0, 1.0, 0.5, 0.25]])
    marginal = torch.nn.Linear(32, 64, bias=False)
    teacher = 3 * torch.randn(1, 8, 64)
    loss = {w: selector_loss(drafter, hidden, marginal, block_ids, labels, weights, offset, normaliser=2.0,
                             teacher_logits=teacher, distill_weight=w).loss for w in (0.0, 0.5, 1.0)}
    picked = weights[0] > 0
    h, prev = hidden[0, picked], previous_tokens(block_ids, labels, offset)[0, picked]
    with torch.no_grad():
        scores, _, _, candidates = selector.teacher_forced(h, marginal(h), prev, labels[0, picked])
    t = teacher[0, picked] if candidates is None else teacher[0, picked].gather(-1, candidates)
    kl = F.kl_div(F.log_softmax(scores, -1), F.log_softmax(t, -1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(loss[1.0], (kl * weights[0, picked]).sum() / 2.0)
    torch.testing.assert_close(loss[0.5], (loss[0.0] + loss[1.0]) / 2)
    loss[1.0].backward()
    assert selector.successor_codebook.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("top_k", [4, 64])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("distill", [0.0, 0.5, 1.0])
def test_selector_loss_reads_the_marginal_losss_logits_and_teacher_as_if_computed_again(top_k, temperature, distill):
    """The trainer hands the selector's loss the marginal loss's logits and teacher log-probabilities
    (`marginal=`) instead of computing them again: the same loss and gradients as computing them, and the marginal
    loss without its hard-label term at distillation weight 1 (it is multiplied by 0) as with it."""
    from flashdraft.train.loss import dflash_loss

    block_ids = torch.tensor([[7, MASK, MASK, MASK, 9, MASK, MASK, MASK]])
    labels = torch.tensor([[0, 11, 12, 13, 0, 21, 22, 23]])
    offset = torch.arange(4).repeat(2)[None]
    target = tiny_target().double()
    torch.manual_seed(1)
    drafter = DFlash2DraftModel(make_dflash2_config(target.config, num_layers=2, block_size=4, mask_token_id=MASK,
                                                    selector_rank=4, selector_top_k=top_k, conv_kernel_size=3,
                                                    conv_group_size=8)).double()
    weights = torch.tensor([[0.0, 1.0, 0.5, 0.25, 0.0, 1.0, 0.5, 0.25]], dtype=torch.float64)
    read_out = torch.nn.Linear(32, 64, bias=False).double()
    teacher = 3 * torch.randn(1, 8, 64, dtype=torch.float64)
    results = []
    for shared in (False, True):
        drafter.zero_grad()
        read_out.zero_grad()
        hidden = torch.randn(1, 8, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2),
                             requires_grad=True)
        out = dflash_loss(hidden, read_out, labels, weights, offset, 4, normaliser=2.0, teacher_logits=teacher,
                          distill_weight=distill, temperature=temperature, keep=True)
        assert (out.logits is not None) and ((out.teacher_log_probs is not None) == (distill > 0))
        picked = selector_loss(drafter, hidden, read_out, block_ids, labels, weights, offset, normaliser=2.0,
                               teacher_logits=teacher, distill_weight=distill, temperature=temperature,
                               marginal=out if shared else None)
        (out.loss + picked.loss).backward()
        results.append((out.loss.detach(), picked.loss.detach(), picked.hits, hidden.grad.clone(),
                        drafter.candidate_selector.successor_codebook.weight.grad.clone(), read_out.weight.grad.clone()))
    for computed, shared in zip(*results):
        torch.testing.assert_close(shared, computed)
    if distill:  # the marginal loss is the stated mix of its two terms
        import torch.nn.functional as F
        picked = weights[0] > 0
        hidden = torch.randn(1, 8, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        logits = read_out(hidden[0, picked]).detach()
        ce = F.cross_entropy(logits, labels[0, picked], reduction="none")
        kl = F.kl_div(F.log_softmax(logits / temperature, -1), F.log_softmax(teacher[0, picked] / temperature, -1),
                      log_target=True, reduction="none").sum(-1) * temperature ** 2
        want = (((1 - distill) * ce + distill * kl) * weights[0, picked]).sum() / 2.0
        torch.testing.assert_close(results[0][0], want.float())


def _examples():
    g = torch.Generator().manual_seed(0)
    examples = []
    for i in range(16):
        n = int(torch.randint(30, 48, (1,), generator=g))
        ids = [BOS] + progression(i * 3, 1 + i % 3, n - 1, 60)
        examples.append(Example(torch.tensor(ids), torch.tensor([False] * 4 + [True] * (n - 4))))
    return examples


def test_dflash2_trains_exports_zlabs_layout_and_drafts_losslessly(tmp_path):
    target = tiny_target()
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), block_size=4, num_draft_layers=2, mask_token_id=MASK,
                      num_anchors=8, lr=3e-3, max_length=64, batch_size=4, max_steps=12, progress=False,
                      eval_at_start=False, seed=0, save_every=12, arch="dflash2", selector_rank=4, selector_top_k=4,
                      conv_kernel_size=3, conv_group_size=8, export_dtype="float32")
    trainer = Trainer(cfg, target_model=target, examples=_examples())
    start = {k: v.detach().clone() for k, v in trainer.drafter.state_dict().items()}
    result = trainer.train()
    assert all(torch.isfinite(torch.tensor(result.losses))) and result.losses[-1] < result.losses[0]
    records = [json.loads(line) for line in open(result.log_path) if '"selector_acc"' in line]
    assert records and 0.0 <= records[-1]["selector_acc"] <= 1.0
    final = result.final_dir
    config = json.loads(open(f"{final}/config.json").read())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_top_k"] == 4
    state = load_file(f"{final}/model.safetensors")
    assert "candidate_selector.predecessor_codebook" in state
    drafter = load_drafter(final)
    assert type(drafter) is DFlash2DraftModel
    trained = drafter.state_dict()
    for name in ("layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
                 "candidate_selector.successor_codebook.weight", "candidate_selector.hidden_projection.weight"):
        assert not torch.equal(trained[name], start[name]), name
    prompts = [[BOS] + progression(5, 2, 6, 60), [BOS] + progression(30, 1, 4, 60)]
    refs = [target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    with SpecEngine(target, drafter) as engine:
        results = engine.generate(prompts, SamplingParams(max_new_tokens=16))
    assert [r.token_ids for r in results] == refs


def test_dflash2_options_need_the_arch():
    with pytest.raises(ValueError, match="selector_rank"):
        check_config(TrainConfig(selector_rank=8))
    with pytest.raises(ValueError, match="arch"):
        check_config(TrainConfig(arch="dflash3"))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        check_config(TrainConfig(arch="dflash2", draft_vocab_size=100))
    with pytest.raises(ValueError, match="selector_lr"):
        check_config(TrainConfig(selector_lr=1e-3))
    with pytest.raises(ValueError, match="selector_distill_weight"):
        check_config(TrainConfig(selector_distill_weight=0.5))


def test_the_selector_learns_at_its_own_rate(tmp_path):
    """`selector_lr`: the selector's parameters in an optimizer group of their own. With lr 0 for the rest, a step
    moves the selector (codebooks, projection) and nothing else."""
    target = tiny_target()
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), block_size=4, num_draft_layers=2, mask_token_id=MASK,
                      num_anchors=8, lr=0.0, selector_lr=1e-2, max_length=64, batch_size=4, max_steps=2,
                      warmup_ratio=0.0, progress=False, eval_at_start=False, seed=0, save_every=2, arch="dflash2",
                      selector_rank=4, selector_top_k=4, conv_kernel_size=3, conv_group_size=8,
                      export_dtype="float32")
    trainer = Trainer(cfg, target_model=target, examples=_examples())
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [0.0, 1e-2]
    start = {k: v.detach().clone() for k, v in trainer.drafter.state_dict().items()}
    trainer.train()
    for name, tensor in trainer.drafter.state_dict().items():
        assert torch.equal(tensor, start[name]) != name.startswith("candidate_selector."), name


def test_dflash2_training_starts_from_a_dflash1_drafter(tmp_path):
    """--arch dflash2 --init-from a DFlash-1 drafter: its weights copied, the convolutions the identity, so the new
    drafter's hidden states are the DFlash-1 drafter's; the other way round is refused."""
    from flashdraft.model import DFlashDraftModel
    from flashdraft.model.drafter import make_draft_config

    target = tiny_target()
    torch.manual_seed(3)
    dflash1 = DFlashDraftModel(make_draft_config(target.config, num_layers=2, block_size=4, mask_token_id=MASK))
    dflash1.save_pretrained(tmp_path / "dflash1")
    common = dict(block_size=4, num_draft_layers=2, mask_token_id=MASK, num_anchors=4, max_length=64, batch_size=4,
                  max_steps=1, progress=False, eval_at_start=False)
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), arch="dflash2", selector_rank=4, selector_top_k=4,
                      conv_kernel_size=3, conv_group_size=8, init_from=str(tmp_path / "dflash1"), **common)
    upgraded = Trainer(cfg, target_model=target, examples=_examples()).drafter
    assert type(upgraded) is DFlash2DraftModel
    source = DFlashDraftModel.from_pretrained(tmp_path / "dflash1", dtype=torch.float32).state_dict()
    for name, tensor in upgraded.state_dict().items():
        if name in source and not name.startswith("rotary_emb."):
            assert torch.equal(tensor, source[name]), name
    seq = one_sequence(dflash1.double(), target.double(), 40, [3, 11, 20], 4)
    mask = training_mask("sdpa", seq.anchors, seq.valid, 4, False)
    with torch.no_grad():
        torch.testing.assert_close(upgraded.double().eval()(seq.noise, seq.position_ids, seq.feats, seq.ctx_pos,
                                                            seq.valid, mask),
                                   dflash1.eval()(seq.noise, seq.position_ids, seq.feats, seq.ctx_pos, seq.valid, mask))
    upgraded.save_pretrained(tmp_path / "dflash2")
    back = TrainConfig(output_dir=str(tmp_path / "run1"), init_from=str(tmp_path / "dflash2"), **common)
    with pytest.raises(ValueError, match="DFlash2 drafter"):
        Trainer(back, target_model=tiny_target(), examples=_examples())


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_a_shallower_drafter_grows_into_a_deeper_one_that_drafts_what_it_did(tmp_path, arch):
    """--init-from a 1-layer drafter with --num-draft-layers 3: its layer starts the first one, the two added ones
    pass the residual through, so the grown drafter's hidden states are the source's exactly; the added layers
    still train (their gradients are not zero); a deeper source into a shallower drafter is refused."""
    from flashdraft.model import DFlashDraftModel
    from flashdraft.model.drafter import make_draft_config

    target = tiny_target()
    torch.manual_seed(4)
    shallow = DFlashDraftModel(make_draft_config(target.config, num_layers=1, block_size=4, mask_token_id=MASK,
                                                 target_layer_ids=[0, 1]))
    shallow.save_pretrained(tmp_path / "shallow")
    common = dict(block_size=4, mask_token_id=MASK, num_anchors=4, max_length=64, batch_size=4, max_steps=1,
                  progress=False, eval_at_start=False, arch=arch, target_layer_ids=[0, 1])
    if arch == "dflash2":
        common.update(selector_rank=4, selector_top_k=4, conv_kernel_size=3, conv_group_size=8)
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), num_draft_layers=3, init_from=str(tmp_path / "shallow"),
                      **common)
    grown = Trainer(cfg, target_model=target, examples=_examples()).drafter
    assert len(grown.layers) == 3
    seq = one_sequence(shallow.double(), target.double(), 40, [3, 11, 20], 4)
    mask = training_mask("sdpa", seq.anchors, seq.valid, 4, False)
    args = (seq.noise, seq.position_ids, seq.feats, seq.ctx_pos, seq.valid, mask)
    with torch.no_grad():
        torch.testing.assert_close(grown.double().eval()(*args), shallow.eval()(*args))
    grown.train()(*args).pow(2).sum().backward()
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        assert grown.layers[2].get_submodule(name.rsplit(".", 1)[0]).weight.grad.abs().sum() > 0, name
    grown.save_pretrained(tmp_path / "deep")
    back = TrainConfig(output_dir=str(tmp_path / "run1"), num_draft_layers=2, init_from=str(tmp_path / "deep"),
                       **common)
    with pytest.raises(ValueError, match="3 draft layers, more than the 2"):
        Trainer(back, target_model=tiny_target(), examples=_examples())
