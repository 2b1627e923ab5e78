"""DFlash2 drafters (`flashdraft/model/dflash2.py`, `flashdraft/engine/dflash2_proposer.py`): z-lab's checkpoint
layout, the convolution's block-causality, greedy output equal to the target's own `generate` (fast and generic
target paths, eager and compiled, batch > 1), and sampled output distributed as the target's with DFlash2 drafts:
under the default sampler (sampled rows race with the position's noise: on the marginal by default, or through the
selector) and under rejection sampling with the selector's own q given to the verifier. Exactness against z-lab's
package: tests/test_zlab_roundtrip.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_sampling import N_LONG, N_LONG_SAMPLES, N_SAMPLES, P_MIN, PROMPT, VOCAB, empirical, exact_distribution, \
    fit, null_total_variation, per_position_pvalues
from test_policy import ScriptedWidths
from test_sampling import target as sampling_target  # noqa: F401  (its 8-token target fixture)
from tiny import MASK_ID, greedy_reference, make_target

from flashdraft import DFlashDraftModel, SamplingParams, SpecEngine
from flashdraft.engine import EngineConfig
from flashdraft.engine.dflash2_proposer import DEFAULT_WALK_CANDIDATES, DFlash2Proposer, greedy_choice, race_choice, \
    sample_choice
from flashdraft.engine.proposers import DFlashProposer, ProposalInput
from flashdraft.loading import load_drafter
from flashdraft.model import CheckpointError, DFlash2DraftModel, TargetModel, make_dflash2_config
from flashdraft.model.dflash2 import CODEBOOKS, CandidateSelector, DynamicCausalConv, dynamic_causal_conv, follow, \
    tap_by_tap_conv, top_k

PROMPTS = [[3, 4, 5, 6], [10, 11], [20, 21, 22, 23, 24, 25, 26]]


def make_dflash2(target, block_size=4, seed=1, top_k=4, dtype=torch.float64, mask_token_id=MASK_ID):
    """A random DFlash2 drafter whose convolutions and selector are far from the identity / from zero, so that both
    change what it drafts."""
    torch.manual_seed(seed)
    cfg = make_dflash2_config(target.config, num_layers=2, block_size=block_size, mask_token_id=mask_token_id,
                              selector_rank=8, selector_top_k=top_k, conv_kernel_size=3, conv_group_size=8)
    drafter = DFlash2DraftModel(cfg)
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.normal_(0, 0.5)
                conv.kernel_projection.weight.normal_(0, 0.3)
        drafter.candidate_selector.hidden_projection.weight.normal_(0, 2.0)
    return drafter.to(dtype).eval()


@pytest.fixture(scope="module")
def qwen3():
    return make_target("qwen3")


def test_checkpoint_is_zlabs_layout_and_loads_both_codebook_spellings(qwen3, tmp_path):
    drafter = make_dflash2(qwen3)
    out = drafter.save_pretrained(tmp_path / "d2")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and "auto_map" not in cfg
    assert not (out / "dflash.py").exists()
    assert {k: cfg["dflash_config"][k] for k in ("selector_rank", "selector_top_k", "conv_kernel_size",
                                                 "conv_group_size")} == {"selector_rank": 8, "selector_top_k": 4,
                                                                         "conv_kernel_size": 3, "conv_group_size": 8}
    state = load_file(str(out / "model.safetensors"))
    assert set(CODEBOOKS) <= set(state) and not any(f"{c}.weight" in state for c in CODEBOOKS)
    assert "layers.1.mlp_conv.base_kernel" in state and "layers.0.attention_conv.kernel_projection.weight" in state
    again = load_drafter(out)
    assert type(again) is DFlash2DraftModel
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), again.state_dict().values()))
    # what a fresh model's transformers save_pretrained writes: the codebooks with `.weight`
    save_file({f"{k}.weight" if k in CODEBOOKS else k: v for k, v in state.items()}, str(out / "model.safetensors"))
    assert torch.equal(load_drafter(out).candidate_selector.successor_codebook.weight,
                       drafter.candidate_selector.successor_codebook.weight)


def test_each_class_loads_only_its_architecture(qwen3, tmp_path):
    out = make_dflash2(qwen3).save_pretrained(tmp_path / "d2")
    with pytest.raises(CheckpointError, match="load it with DFlash2DraftModel"):
        DFlashDraftModel.from_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    del cfg["dflash_config"]["selector_top_k"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="selector_top_k"):
        DFlash2DraftModel.from_pretrained(out)
    from tiny import make_drafter

    one = make_drafter(qwen3).save_pretrained(tmp_path / "d1")
    with pytest.raises(CheckpointError, match="load it with DFlashDraftModel"):
        DFlash2DraftModel.from_pretrained(one)
    assert type(load_drafter(one)) is DFlashDraftModel


def test_convolution_is_causal_inside_each_block():
    torch.manual_seed(0)
    x, dynamic, base = torch.randn(2, 8, 16), torch.randn(2, 8, 3, 2), torch.randn(3, 16)
    both = dynamic_causal_conv(x, dynamic, base, segment=4)
    halves = [dynamic_causal_conv(x[:, i:i + 4], dynamic[:, i:i + 4], base, segment=4) for i in (0, 4)]
    assert torch.equal(both, torch.cat(halves, 1))  # blocks never see each other
    changed = x.clone()
    changed[:, 2] += 1.0
    moved = dynamic_causal_conv(changed, dynamic, base, segment=8)
    assert torch.equal(moved[:, :2], dynamic_causal_conv(x, dynamic, base, segment=8)[:, :2])
    assert not torch.equal(moved[:, 2:5], dynamic_causal_conv(x, dynamic, base, segment=8)[:, 2:5])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_convolution_is_zlabs_up_to_rounding(dtype):
    """float64: equal to the tap-by-tap loop to summation order; bfloat16: no farther from the exact result (on the
    same rounded inputs) than the loop in bfloat16 is, in the worst and the mean position."""
    torch.manual_seed(1)
    x, dynamic, base = (t.to(dtype) for t in (torch.randn(3, 32, 64), torch.randn(3, 32, 4, 4), torch.randn(4, 64)))
    exact = tap_by_tap_conv(x.double(), dynamic.double(), base.double(), 16)
    ours = dynamic_causal_conv(x, dynamic, base, 16)
    assert ours.dtype == dtype
    if dtype == torch.float64:
        assert torch.allclose(ours, exact, rtol=0, atol=1e-12)
    else:
        ours, loop = (ours.double() - exact).abs(), (tap_by_tap_conv(x, dynamic, base, 16).double() - exact).abs()
        assert ours.max() <= loop.max() and ours.mean() <= loop.mean()


def test_training_and_drafting_convolve_alike():
    """Under autograd the pair of convolutions runs z-lab's loop, otherwise the windowed form: same outputs (float64)
    and gradients flow to the input, the static kernels and the projection."""
    torch.manual_seed(2)
    conv = DynamicCausalConv(32, 3, 8).double()
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(0, 0.3)
    x = torch.randn(2, 16, 32, dtype=torch.float64, requires_grad=True)
    h, kernel = conv.prepare(x, 8)
    trained = conv.finish(torch.tanh(h), kernel, 8)
    trained.sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0
               for t in (x, conv.base_kernel, conv.kernel_projection.weight))
    with torch.no_grad():
        h, kernel = conv.prepare(x, 8)
        drafted = conv.finish(torch.tanh(h), kernel, 8)
    assert torch.allclose(drafted, trained, rtol=0, atol=1e-12)


def test_fresh_convolutions_are_the_identity(qwen3):
    torch.manual_seed(0)
    cfg = make_dflash2_config(qwen3.config, num_layers=1, block_size=4, mask_token_id=MASK_ID, conv_group_size=8)
    conv = DFlash2DraftModel(cfg).layers[0].attention_conv
    x = torch.randn(3, 4, qwen3.config.hidden_size)
    out, dynamic = conv.prepare(x, 4)
    assert torch.equal(out, x) and torch.equal(conv.finish(x, dynamic, 4), x)


def test_selector_changes_the_drafts(qwen3):
    """The walk is not the marginal's argmax: the selector's pair scores decide some positions."""
    drafter = make_dflash2(qwen3, block_size=8)
    proposer = DFlashProposer(drafter, TargetModel(qwen3))
    assert type(proposer) is DFlash2Proposer
    torch.manual_seed(3)
    hidden = torch.randn(16, 7, qwen3.config.hidden_size, dtype=torch.float64)
    walk = drafter.select(hidden, proposer.lm_head, torch.randint(0, 90, (16,)), greedy_choice)
    assert (walk["tokens"] != walk["logits"].argmax(-1)).any()
    assert (walk["tokens"][..., None] == walk["candidates"]).any(-1).all()


def sequential_walk(selector, hidden, logits, anchor, pick, candidates=None):
    """z-lab's `select` loop: position by position, each row's scores from the token chosen just before it;
    `pick(i, scores [b, top_k], candidates [b, top_k]) -> index [b]`. `candidates` [b, k, n]: walk among these
    instead of the marginal's top-k (unary scores: their logits)."""
    if candidates is None:
        unary, candidates = torch.topk(logits, selector.top_k, dim=-1)
    else:
        unary = logits.gather(-1, candidates)
    query = selector.hidden_projection(hidden)
    previous, tokens, rows = anchor, [], []
    for i in range(hidden.shape[1]):
        scores = unary[:, i] + selector.pair_scores(query[:, i], previous, candidates[:, i])
        previous = candidates[:, i].gather(-1, pick(i, scores, candidates[:, i])[:, None])[:, 0]
        tokens.append(previous)
        rows.append(scores)
    return torch.stack(tokens, 1), torch.stack(rows, 1)


def walk_inputs(target, drafter, chooser: str, rows: int, seed: int):
    """Draft hidden states [rows, 15, H], their marginal logits, anchors, and a `choose` for the selector's walk
    with the same choice as `pick` for `sequential_walk`: the argmax ("greedy") or the race on softmax(s / T) with
    random noise and temperatures ("race")."""
    torch.manual_seed(seed)
    k, vocab = 15, target.config.vocab_size
    hidden = torch.randn(rows, k, target.config.hidden_size, dtype=torch.float64)
    logits = drafter.compute_logits(hidden, DFlashProposer(drafter, TargetModel(target)).lm_head)
    anchor = torch.randint(0, vocab, (rows,))
    if chooser == "greedy":
        return hidden, logits, anchor, greedy_choice, lambda i, s, c: s.argmax(-1)
    noise = torch.empty(rows, k, vocab, dtype=torch.float64).exponential_()
    inverse_temperature = torch.rand(rows, dtype=torch.float64) + 0.5
    pick = lambda i, s, c: (torch.softmax(s.float() * inverse_temperature[:, None], -1)  # noqa: E731
                            / noise[:, i].gather(-1, c)).argmax(-1)
    return hidden, logits, anchor, race_choice(noise, inverse_temperature), pick


@pytest.mark.parametrize("chooser", ["greedy", "race"])
def test_selector_walk_is_the_sequential_one(qwen3, chooser):
    """The walk without a loop over positions (every choice at once, then the path) drafts what the plain
    left-to-right walk drafts, and hands back the score rows that walk went through."""
    drafter = make_dflash2(qwen3, block_size=16, top_k=6)
    selector = drafter.candidate_selector
    hidden, logits, anchor, choose, pick = walk_inputs(qwen3, drafter, chooser, 64, 4)
    walk = selector.select(hidden, logits, anchor, choose)
    tokens, rows = sequential_walk(selector, hidden, logits, anchor, pick)
    assert (tokens != logits.argmax(-1)).any()  # the pair term decides some positions
    assert torch.equal(walk["tokens"], tokens)
    assert torch.allclose(walk["scores"], rows, rtol=0, atol=1e-12)


@pytest.mark.parametrize("chooser", ["greedy", "race"])
def test_a_whole_vocabulary_selector_walks_as_the_sequential_one(qwen3, chooser):
    """With every token a candidate (top_k = the vocabulary) the walk goes position by position over all tokens:
    it drafts what z-lab's left-to-right loop drafts, tokens outside any small top-k of the marginal included, and
    its score rows are that loop's in vocabulary order; the teacher-forced scores are the same rows."""
    vocab = qwen3.config.vocab_size
    drafter = make_dflash2(qwen3, block_size=16, top_k=vocab)
    selector = drafter.candidate_selector
    assert selector.whole_vocabulary
    hidden, logits, anchor, choose, pick = walk_inputs(qwen3, drafter, chooser, 32, 5)
    walk = selector.select(hidden, logits, anchor, choose)
    tokens, rows = sequential_walk(selector, hidden, logits, anchor, pick)
    assert torch.equal(walk["tokens"], tokens)
    assert (tokens != logits.argmax(-1)).any()
    assert ((tokens[..., None] == logits.topk(8, dim=-1).indices).sum(-1) == 0).any()  # drafted outside a top-8
    in_vocabulary_order = torch.zeros_like(rows).scatter_(-1, logits.topk(vocab, dim=-1).indices, rows)
    assert torch.allclose(walk["scores"], in_vocabulary_order, rtol=0, atol=1e-12)
    previous = torch.cat([anchor[:, None], tokens[:, :-1]], 1)
    scores, label_index, present, _ = selector.teacher_forced(hidden.flatten(0, 1), logits.flatten(0, 1),
                                                           previous.flatten(), tokens.flatten())
    assert present.all() and torch.equal(label_index, tokens.flatten())
    assert torch.allclose(scores, walk["scores"].flatten(0, 1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("chooser", ["greedy", "race"])
def test_a_narrowed_whole_vocabulary_walk_is_the_walk_among_its_ranking_top_k(qwen3, chooser):
    """`narrow_to` K: the walk of a whole-vocabulary selector among each position's K best by `ranking` is the
    left-to-right walk over exactly those candidates (unary scores: the logits); narrowed to the whole vocabulary it
    drafts what the walk over every token drafts; and the proposer ranks racing rows by s / T - log E, the race
    with the pair term left out."""
    vocab = qwen3.config.vocab_size
    drafter = make_dflash2(qwen3, block_size=16, top_k=vocab)
    selector = drafter.candidate_selector
    hidden, logits, anchor, choose, pick = walk_inputs(qwen3, drafter, chooser, 32, 8)
    ranking = logits + torch.randn_like(logits)
    walk = selector.select(hidden, logits, anchor, choose, narrow_to=5, ranking=ranking)
    candidates = ranking.topk(5, dim=-1).indices
    assert torch.equal(walk["candidates"].sort(-1).values, candidates.sort(-1).values)
    assert torch.equal(walk["tokens"], sequential_walk(selector, hidden, logits, anchor, pick, walk["candidates"])[0])
    everything = selector.select(hidden, logits, anchor, choose, narrow_to=vocab)
    assert torch.equal(everything["tokens"], selector.select(hidden, logits, anchor, choose)["tokens"])

    proposer = DFlash2Proposer(drafter, TargetModel(qwen3), walk_candidates=5)
    proposer._draft_hidden = lambda *args: hidden
    block = torch.full((32, 16), MASK_ID)
    block[:, 0] = anchor
    if chooser == "greedy":
        drafts = proposer._draft_tokens(None, None, None, None, block, None, None)[0]
        expected = selector.select(hidden, logits, anchor, greedy_choice, narrow_to=5)["tokens"]
    else:
        torch.manual_seed(9)
        noise = torch.empty(32, 15, vocab, dtype=torch.float64).exponential_()
        inverse_temperature = torch.rand(32, dtype=torch.float64) + 0.5
        drafts = proposer._draft_tokens(None, None, None, None, block, None, None, noise, inverse_temperature)[0]
        race = logits * inverse_temperature[:, None, None] - noise.log()
        expected = selector.select(hidden, logits, anchor, race_choice(noise, inverse_temperature), narrow_to=5,
                                   ranking=race)["tokens"]
    assert torch.equal(drafts, expected)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="walk_candidates"):
            DFlash2Proposer(drafter, TargetModel(qwen3), walk_candidates=bad)
        with pytest.raises(ValueError, match="walk_candidates"):
            EngineConfig(walk_candidates=bad)
    # the engine's option reaches the proposer (None: the proposer's default)
    for option, walked in ((None, DEFAULT_WALK_CANDIDATES), (0, 0), (7, 7)):
        with SpecEngine(qwen3, drafter, walk_candidates=option) as engine:
            assert engine.proposer.walk_candidates == walked


@pytest.mark.parametrize("sampled_race", ["marginal", "selector"])
def test_sampled_rows_race_as_configured_and_greedy_rows_walk(qwen3, sampled_race):
    """Under counter-based noise, in a batch of sampled and greedy rows: greedy rows draft the selector's greedy walk
    whatever `sampled_race` is; sampled rows draft the marginal's race over the whole vocabulary ("marginal", which
    drafts tokens outside the top-k) or the race walk over the top-k ("selector")."""
    drafter = make_dflash2(qwen3, block_size=16, top_k=4)
    proposer = DFlash2Proposer(drafter, TargetModel(qwen3), sampled_race=sampled_race)
    torch.manual_seed(7)
    b, k, vocab = 48, 15, qwen3.config.vocab_size
    hidden = 0.3 * torch.randn(b, k, qwen3.config.hidden_size, dtype=torch.float64)  # flat marginals
    proposer._draft_hidden = lambda *args: hidden
    block = torch.full((b, 16), MASK_ID)
    block[:, 0] = torch.randint(0, vocab, (b,))
    greedy = torch.arange(b) % 3 == 0
    noise = torch.empty(b, k, vocab).exponential_().masked_fill(greedy[:, None, None], 1.0)
    inverse_temperature = torch.where(greedy, 1.0, 1.0 / (torch.rand(b) + 0.5))
    tokens = proposer._draft_tokens(None, None, None, None, block, None, None, noise, inverse_temperature, greedy)[0]

    logits = drafter.compute_logits(hidden, proposer.lm_head)
    walk = lambda choose: drafter.select(hidden, proposer.lm_head, block[:, 0], choose)["tokens"]  # noqa: E731
    assert torch.equal(tokens[greedy], walk(greedy_choice)[greedy])
    in_top = (tokens[..., None] == torch.topk(logits, 4, dim=-1).indices).any(-1)
    sampled = ~greedy
    if sampled_race == "marginal":
        race = torch.softmax(logits.float() * inverse_temperature[:, None, None], -1) / noise
        assert torch.equal(tokens[sampled], race.argmax(-1)[sampled])
        assert not in_top[sampled].all()
        proposer._draft_hidden = lambda *args: hidden[sampled]
        every_row_sampled = proposer._draft_tokens(None, None, None, None, block[sampled], None, None,
                                                   noise[sampled], inverse_temperature[sampled])[0]
        assert torch.equal(every_row_sampled, tokens[sampled])  # no greedy row: the walk is skipped
    else:
        assert torch.equal(tokens[sampled], walk(race_choice(noise, inverse_temperature))[sampled])
        assert in_top[sampled].all()


@pytest.mark.parametrize("whole_vocabulary,walk_candidates", [(False, 0), (True, 0), (True, 3)],
                         ids=["top-k", "whole-vocabulary", "whole-vocabulary-narrowed"])
def test_the_selector_race_keeps_plain_decodings_seeded_text(whole_vocabulary, walk_candidates):
    """The selector's race: seeded requests beside a greedy row still get plain decoding's text, and the greedy row
    the target's own, with candidates among the top-k, the whole vocabulary, or the whole vocabulary's walk
    narrowed to each position's likeliest race winners."""
    target = make_target("qwen3")
    drafter = make_dflash2(target, top_k=target.config.vocab_size if whole_vocabulary else 4)
    view = TargetModel(target)
    view.set_layer_ids(drafter.target_layer_ids)
    params = [SamplingParams(max_new_tokens=20, temperature=t, seed=s) for t, s in ((1.0, 1), (0.7, 2), (0.0, None))]
    plain = [SpecEngine(target).generate([p], [q])[0].token_ids for p, q in zip(PROMPTS, params)]
    assert plain[2] == greedy_reference(target, PROMPTS[2], 20)
    proposer = DFlash2Proposer(drafter, view, sampled_race="selector", walk_candidates=walk_candidates)
    with SpecEngine(view, proposer=proposer, block_size=drafter.block_size, draft_policy="fixed") as engine:
        assert [r.token_ids for r in engine.generate(PROMPTS, params)] == plain
    with pytest.raises(ValueError, match="sampled_race"):
        DFlash2Proposer(drafter, view, sampled_race="argmax")
    # by default a top-k selector's rows race on the marginal, a whole-vocabulary selector's on the selector
    assert DFlash2Proposer(drafter, view).sampled_race == ("selector" if whole_vocabulary else "marginal")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_of_wide_rows_is_torch_topks(dtype):
    """The top-k through the blocks with the largest maxima returns torch.topk's values, largest first, at indices
    that hold them, also where many values tie (integers: ties across the k-th place and inside one block)."""
    torch.manual_seed(6)
    rows = [torch.randn(2, 15, 8192) * 4, torch.randint(0, 40, (2, 15, 8192)).float(),
            torch.randint(0, 3, (2, 15, 4096)).float()]
    one_block = torch.full((1, 4096), -1.0)
    one_block[0, 64:72] = torch.arange(8.0)  # every winner in one block of 64
    for x in [r.to(dtype) for r in rows] + [one_block.to(dtype)]:
        values, ids = top_k(x, 8)
        assert values.dtype == dtype and torch.equal(values, torch.topk(x, 8, dim=-1).values)
        assert torch.equal(x.gather(-1, ids), values)
        assert (ids.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct entries
    narrow = torch.randn(3, 500).to(dtype)  # too narrow to block: torch.topk itself
    assert all(torch.equal(a, b) for a, b in zip(top_k(narrow, 8), torch.topk(narrow, 8, dim=-1)))


def test_selector_walk_over_a_wide_vocabulary_is_the_sequential_one():
    """Over a vocabulary wide enough for the blocked top-k (float32, as bf16 drafters draft), the walk drafts what
    z-lab's loop over torch.topk's candidates drafts."""
    torch.manual_seed(7)
    selector = CandidateSelector(4096, 32, rank=8, top_k=8)
    with torch.no_grad():
        selector.hidden_projection.weight.normal_(0, 2.0)
    hidden, logits = torch.randn(16, 15, 32), torch.randn(16, 15, 4096) * 2
    anchor = torch.randint(0, 4096, (16,))
    with torch.no_grad():
        walk = selector.select(hidden, logits, anchor, greedy_choice)
        tokens, rows = sequential_walk(selector, hidden, logits, anchor, lambda i, s, c: s.argmax(-1))
    assert (tokens != logits.argmax(-1)).any()
    assert torch.equal(walk["tokens"], tokens)
    torch.testing.assert_close(walk["scores"], rows)


def test_drafting_copies_follow_weight_updates(qwen3):
    """Drafting convolves and walks with cached copies of the DFlash2 weights (taps reversed, float32 or wider):
    equal to what autograd's path computes, and rebuilt after the weights change in place (training between
    evals)."""
    drafter = make_dflash2(qwen3, block_size=4)
    selector = drafter.candidate_selector
    torch.manual_seed(8)
    width = len(drafter.target_layer_ids) * drafter.config.hidden_size
    inputs = (torch.randn(2, 4, drafter.config.hidden_size, dtype=torch.float64), torch.arange(8, 12).repeat(2, 1),
              torch.randn(2, 8, width, dtype=torch.float64), torch.arange(8).repeat(2, 1))
    hidden = torch.randn(4, 3, drafter.config.hidden_size, dtype=torch.float64)
    logits = torch.randn(4, 3, qwen3.config.vocab_size, dtype=torch.float64)
    anchor = torch.randint(0, qwen3.config.vocab_size, (4,))

    def drafted_and_trained():
        with torch.no_grad():
            drafted = drafter(*inputs)
            walk = selector.select(hidden, logits, anchor, greedy_choice)["tokens"]
        trained = drafter(*inputs)  # autograd on: z-lab's tap-by-tap convolutions
        assert trained.requires_grad
        loop = sequential_walk(selector, hidden, logits, anchor, lambda i, s, c: s.argmax(-1))[0]
        return drafted, trained.detach(), walk, loop

    before = drafted_and_trained()
    with torch.no_grad():
        for layer in drafter.layers:
            layer.attention_conv.kernel_projection.weight.mul_(-1.5)
            layer.mlp_conv.base_kernel.add_(0.3)
        selector.predecessor_codebook.weight.mul_(-3.0)
        selector.hidden_projection.weight.add_(0.5)
    after = drafted_and_trained()
    for drafted, trained, walk, loop in (before, after):
        torch.testing.assert_close(drafted, trained)
        assert torch.equal(walk, loop)
    assert not torch.allclose(after[0], before[0]) and not torch.equal(after[2], before[2])


def test_follow_composes_the_maps():
    torch.manual_seed(5)
    steps = torch.randint(0, 5, (32, 11, 5))
    steps[:, 0] = steps[:, 0, :1]  # position 0: one choice whatever came before
    path, index = [], steps[:, 0, 0]
    for i in range(11):
        index = steps[:, i].gather(-1, index[:, None])[:, 0]
        path.append(index)
    assert torch.equal(follow(steps), torch.stack(path, 1))


def test_sample_choice_draws_from_q():
    """Each row's index is a sample of softmax(scores / T): frequencies over many draws (chi-square), zero-
    probability candidates never; greedy rows (1/T = 0) take the argmax."""
    torch.manual_seed(6)
    scores = torch.tensor([[0.0, 1.0, -1.0, float("-inf")], [2.0, 0.5, 0.5, 0.0]])[None, None]  # [1, 1, 2, 4]
    choose = sample_choice(torch.tensor([1.0]))
    draws = torch.stack([choose(scores, None)[0, 0] for _ in range(6000)])  # [n, 2]
    for row in range(2):
        q = torch.softmax(scores[0, 0, row], -1)
        counts = torch.bincount(draws[:, row], minlength=4).double()
        assert counts[q == 0].sum() == 0
        expected = q[q > 0].double() * len(draws)
        chi2 = float(((counts[q > 0] - expected) ** 2 / expected).sum())
        assert chi2 < 16.3, (row, chi2)  # p < 0.001 at 2 or 3 degrees of freedom
    greedy = sample_choice(torch.tensor([0.0]))
    assert torch.equal(greedy(scores, None), torch.tensor([[[1, 0]]]))


@pytest.mark.parametrize("arch,compile", [("qwen3", False), ("olmo2", False), ("qwen3", True)],
                         ids=["fast-path", "generic-path", "compiled"])
def test_output_is_the_targets_own(arch, compile):
    """Greedy: the target's own `generate`, in a batch and alone. Sampled under the default sampler: a seeded
    request's text is plain decoding's with that seed, in a batch with a greedy row beside it."""
    target = make_target(arch)
    drafter = make_dflash2(target)
    refs = [greedy_reference(target, p, 24) for p in PROMPTS]
    sampled = [SamplingParams(max_new_tokens=20, temperature=t, seed=s) for t, s in ((1.0, 1), (0.7, 2), (0.0, None))]
    plain = [SpecEngine(target).generate([p], [q])[0].token_ids for p, q in zip(PROMPTS, sampled)]
    with SpecEngine(target, drafter, compile=compile) as engine:
        assert type(engine.proposer) is DFlash2Proposer
        results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=24))
        assert [r.token_ids for r in results] == refs
        assert [engine.generate([p], SamplingParams(max_new_tokens=24))[0].token_ids for p in PROMPTS] == refs
        assert [r.token_ids for r in engine.generate(PROMPTS, sampled)] == plain


def test_short_drafts_keep_the_output(qwen3):
    """Cycles whose widest row verifies fewer positions than the block: the drafter fills only that many (its
    convolutions and selector walk the shorter block) and the text is still the target's greedy text and, seeded
    under the default sampler, plain decoding's."""
    drafter = make_dflash2(qwen3, block_size=8)
    params = [SamplingParams(max_new_tokens=30, temperature=t, seed=s) for t, s in ((0.0, None), (1.0, 3), (0.8, 4))]
    plain = [SpecEngine(qwen3).generate([p], [q])[0].token_ids for p, q in zip(PROMPTS, params)]
    with SpecEngine(qwen3, drafter) as engine:
        assert engine.drafts_to_width and engine.width_choices == (1, 2, 4, 8)
        batch = engine.open_batch()
        batch.policy = ScriptedWidths([2, 1, 4, 1, 2, 2, 8])
        drafted, propose = [], engine.proposer.propose
        engine.proposer.propose = lambda state, inp, size: drafted.append(size) or propose(state, inp, size)
        out = {e.index: e.token_ids for e in engine.add(batch, PROMPTS, params)}
        while batch.rows:
            for e in engine.step(batch):
                out[e.index] = out.get(e.index, []) + e.token_ids
    assert out[0] == greedy_reference(qwen3, PROMPTS[0], 30) and [out[1], out[2]] == plain[1:]
    assert {2, 4} <= set(drafted)


class SoftDraftCounter(DFlash2Proposer):
    """Counts the drafts whose q the selector really spread (not one-hot): the engine hands proposers each drafting
    row's temperature under rejection sampling, so the selector samples and its q reaches the verifier."""

    soft_drafts = 0

    def propose(self, state, inp: ProposalInput, block_size):
        drafts, q = super().propose(state, inp, block_size)
        assert q is not None and torch.allclose(q.sum(-1), torch.ones_like(q.sum(-1)), atol=1e-5)
        self.soft_drafts += int((q.max(-1).values < 0.999).sum())
        return drafts, q


@pytest.mark.parametrize("sampler,top_k,walk_candidates", [("gumbel", 3, 0), ("rejection", 3, 0),
                                                           ("rejection", VOCAB, 0), ("rejection", VOCAB, 3)])
def test_sampling_with_dflash2_drafts_matches_target_distribution(sampling_target, sampler, top_k,  # noqa: F811
                                                                  walk_candidates):
    """The first three tokens' joint distribution (chi-square, TV) and every position up to the tenth, as
    tests/test_sampling.py checks DFlash-1, with a DFlash2 drafter over the same 8-token vocabulary (its selector
    choosing among 3 candidates, among all 8, or among all 8 with the walk narrowed to the marginal's top 3)."""
    params = SamplingParams(temperature=1.0)
    drafter = make_dflash2(sampling_target, top_k=top_k, mask_token_id=VOCAB - 1)
    if sampler == "gumbel":
        engine = SpecEngine(sampling_target, drafter)
        proposer = None
    else:
        view = TargetModel(sampling_target)
        view.set_layer_ids(drafter.target_layer_ids)
        proposer = SoftDraftCounter(drafter, view, walk_candidates=walk_candidates)
        engine = SpecEngine(view, proposer=proposer, block_size=drafter.block_size, sampler="rejection")
    exact = exact_distribution(sampling_target, params)
    counts, long = empirical(engine, params, n_long=N_LONG_SAMPLES)
    p_value, tv = fit(exact, counts)
    assert p_value > P_MIN and tv < 1.5 * null_total_variation(exact, N_SAMPLES) + 0.01, (p_value, tv)
    assert min(per_position_pvalues(sampling_target, params, long)) > P_MIN / N_LONG
    if proposer is not None:
        assert proposer.soft_drafts > 1000  # q really was a distribution, not one-hot drafts


def test_a_wrong_q_is_detected(sampling_target):  # noqa: F811
    """Power: handing the verifier a sharper q than the one the selector sampled from breaks exactness, and the
    chi-square test above catches it."""

    class WrongQ(DFlash2Proposer):
        def _proposal(self, drafts, live, device):
            tokens, q = super()._proposal(drafts, live, device)
            return tokens, q ** 2 / (q ** 2).sum(-1, keepdim=True)

    params = SamplingParams(temperature=1.0)
    drafter = make_dflash2(sampling_target, top_k=3, mask_token_id=VOCAB - 1)
    view = TargetModel(sampling_target)
    view.set_layer_ids(drafter.target_layer_ids)
    engine = SpecEngine(view, proposer=WrongQ(drafter, view), block_size=drafter.block_size, sampler="rejection",
                        draft_policy="fixed")  # every cycle drafts: the test's power does not depend on timing
    counts, _ = empirical(engine, params, n=4000)
    assert fit(exact_distribution(sampling_target, params), counts)[0] < P_MIN


def test_confidence_per_position(qwen3):
    drafter = make_dflash2(qwen3, block_size=6)
    target = TargetModel(qwen3)
    target.set_layer_ids(drafter.target_layer_ids)
    proposer = DFlash2Proposer(drafter, target, confidence=True)
    # whole blocks every cycle: under the adaptive policy a cycle may draft fewer positions (its confidence too)
    with SpecEngine(target, proposer=proposer, block_size=6, draft_policy="fixed") as engine:
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=8))
    conf = proposer.last_confidence
    assert conf.selector.shape == conf.marginal.shape and conf.selector.shape[1] == 5
    assert ((conf.selector > 0) & (conf.selector <= 1) & (conf.marginal > 0) & (conf.marginal <= 1)).all()
