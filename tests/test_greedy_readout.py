"""The greedy read-out through a bf16 copy of an fp32 lm_head (`model/greedy_readout.py`): certified to be the
argmax of the fp32 logits (plus sampled rows' race offsets), on real hidden states, random ones and near-ties built
to be close; greedy output through the engine equals the target's own `generate` with it on, seeded sampled output
the target's own race under the same noise."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from flashdraft import SamplingParams, SpecEngine
from flashdraft.bench.datasets import load_prompts
from flashdraft.engine.noise import exponential_noise, race, race_offsets
from flashdraft.loading import load_pair
from flashdraft.model.greedy_readout import MIN_ROWS, ScreenedArgmax, screening_unavailable
from tiny import drain, finished, needs_native_bf16


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    return load_pair()


def fp32_argmax(lm_head: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return lm_head(x).argmax(dim=-1)


def near_ties(weight: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    """Hidden states whose logits for two tokens a, b differ by 1e-4..1e-1 and lead: x between the two rows' directions,
    moved along w_a - w_b until (w_a - w_b) . x is that gap. bf16 logits cannot order such pairs; the screening must
    hand them to fp32 dot products."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, weight.shape[0], (rows,), generator=g)
    b = torch.randint(0, weight.shape[0], (rows,), generator=g)
    unit = weight / weight.norm(dim=1, keepdim=True)
    x = (4 + 8 * torch.rand(rows, 1, generator=g)) * (unit[a] + unit[b])
    gap = 10 ** (-4 + 3 * torch.rand(rows, generator=g)) * torch.sign(torch.randn(rows, generator=g))
    d = weight[a] - weight[b]
    t = (gap - (d * x).sum(1)) / (d * d).sum(1).clamp_min(1e-6)
    return x + t[:, None] * d


@torch.inference_mode()
def test_screened_argmax_is_the_fp32_argmax(pair):
    target, tokenizer, _ = pair
    lm_head = target.lm_head
    screened = ScreenedArgmax(lm_head)
    prompts = [tokenizer.encode(p.text) for spec in ("default", "ood-code-nl") for p in load_prompts(spec, 6)]
    hidden = torch.cat([target.model(torch.tensor([p])).last_hidden_state[0] for p in prompts])
    assert hidden.shape[0] > 200
    assert torch.equal(screened(hidden), fp32_argmax(lm_head, hidden))
    for seed in range(4):  # random directions and scales, and shapes with leading dimensions
        x = torch.randn(3, 16, lm_head.in_features, generator=torch.Generator().manual_seed(seed)) * (1 + 10 * seed)
        assert torch.equal(screened(x), fp32_argmax(lm_head, x))


@torch.inference_mode()
def test_near_ties_go_to_fp32_and_a_bf16_argmax_alone_would_not_do(pair):
    lm_head = pair[0].lm_head
    screened = ScreenedArgmax(lm_head)
    x = near_ties(lm_head.weight.detach(), 512, seed=1)
    want = fp32_argmax(lm_head, x)
    # the set discriminates: the bf16 copy's own argmax gets a share of these wrong
    bf16_choice = screened.low(x.to(torch.bfloat16)).float().argmax(dim=-1)
    assert (bf16_choice != want).sum() >= 10
    assert torch.equal(screened(x), want)


@torch.inference_mode()
def test_small_calls_and_non_finite_rows_take_the_full_read_out(pair):
    lm_head = pair[0].lm_head
    screened = ScreenedArgmax(lm_head)
    x = torch.randn(MIN_ROWS - 1, lm_head.in_features) * 5
    assert torch.equal(screened(x), fp32_argmax(lm_head, x))
    x = torch.randn(2 * MIN_ROWS, lm_head.in_features) * 5
    x[3, 7] = float("inf")
    assert torch.equal(screened(x), fp32_argmax(lm_head, x))


def test_what_cannot_be_screened_says_why():
    assert "bias" in screening_unavailable(nn.Linear(4, 8))
    assert "bfloat16" in screening_unavailable(nn.Linear(4, 8, bias=False).to(torch.bfloat16))
    assert "Embedding" in screening_unavailable(nn.Embedding(8, 4))
    assert screening_unavailable(nn.Linear(4, 8, bias=False)) is None
    with pytest.raises(ValueError, match="cannot screen"):
        ScreenedArgmax(nn.Linear(4, 8))


@needs_native_bf16  # the default drafter is bf16 only there
def test_the_drafters_bf16_read_out_is_shared_not_copied(pair):
    target, tokenizer, drafter = pair
    engine = SpecEngine(target, drafter, tokenizer, screen_greedy=True)
    assert engine.fast.screened.low is engine.proposer.lm_head  # the same bf16 copy of the target's lm_head
    assert SpecEngine(target, None, tokenizer, screen_greedy=True).fast.screened.low is not None  # its own
    other = nn.Linear(target.lm_head.in_features, target.lm_head.out_features, bias=False).to(torch.bfloat16)
    with pytest.raises(ValueError, match="not this lm_head"):
        ScreenedArgmax(target.lm_head, low=other)


def test_engine_flag(pair):
    target, tokenizer, drafter = pair
    with pytest.raises(ValueError, match="screen_greedy=True but exact mode"):
        SpecEngine(target, drafter, tokenizer, screen_greedy=True, exact=True)
    with pytest.raises(ValueError, match="screen_greedy must be"):
        SpecEngine(target, drafter, tokenizer, screen_greedy="yes")
    assert SpecEngine(target, drafter, tokenizer, screen_greedy=False).fast.screened is None
    assert SpecEngine(target, drafter, tokenizer, exact=True).fast.screened is None  # auto: not in exact mode


@torch.inference_mode()
def test_greedy_output_equals_generate_with_the_screened_read_out(pair):
    """Drafting (ragged widths, lookup steps) and plain decoding, batch > 1, against the target's own generate."""
    target, tokenizer, drafter = pair
    prompts = [tokenizer.encode(p.text) for spec in ("ood-code-nl", "default") for p in load_prompts(spec, 4)]
    params = SamplingParams(max_new_tokens=48)
    for engine in (SpecEngine(target, drafter, tokenizer, screen_greedy=True),
                   SpecEngine(target, None, tokenizer, screen_greedy=True)):
        assert engine.screens_readout
        results = engine.generate(prompts, params)
        for prompt, result in zip(prompts, results):
            ids = torch.tensor([prompt])
            want = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                                   pad_token_id=0)[0, len(prompt):].tolist()
            assert result.token_ids == want[:len(result.token_ids)]
        engine.close()


@torch.inference_mode()
def test_greedy_requests_joining_a_running_batch_with_the_screened_read_out(pair, monkeypatch):
    """Greedy requests whose prompts ride a cycle's forward: the running rows' blocks are read out screened (the
    read-out is called on them), the joining prompts' last logits in full; every output equals the target's own
    `generate`."""
    target, tokenizer, drafter = pair
    prompts = [tokenizer.encode(p.text) for p in load_prompts("ood-code-nl", 5)]
    engine = SpecEngine(target, drafter, tokenizer, screen_greedy=True)
    calls = []
    screened_call = ScreenedArgmax.__call__
    monkeypatch.setattr(ScreenedArgmax, "__call__",
                        lambda self, x, offsets=None: calls.append(x.shape) or screened_call(self, x, offsets))
    params = SamplingParams(max_new_tokens=40)
    batch = engine.open_batch()
    results = {}
    list(engine.add(batch, prompts[:2], params, request_ids=[0, 1]))
    engine.step(batch)
    for i in range(2, 5):  # one request joins per step, riding the running rows' cycle
        assert engine.rides_cycle(batch, [SimpleNamespace(prompt=prompts[i])])
        results.update(finished(engine.step(batch, [prompts[i]], [params], request_ids=[i])))
    results.update(drain(engine, batch))
    assert calls  # the screened read-out ran
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        want = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert results[i] == want[:len(results[i])]


@torch.inference_mode()
def test_flat_logits_hand_the_read_out_back_to_fp32_and_are_probed_again(pair):
    """Where most rows stay undecided (near-ties everywhere) the bf16 pass is wasted: the screening steps aside for
    the full read-out, and tries again every REPROBE_EVERY-th call; the choices stay the fp32 argmax throughout."""
    from flashdraft.model import greedy_readout

    lm_head = pair[0].lm_head
    screened = ScreenedArgmax(lm_head)
    x = near_ties(lm_head.weight.detach(), 64, seed=2)
    want = fp32_argmax(lm_head, x)
    low_calls = []
    low = screened.low
    screened.low = lambda h: low_calls.append(1) or low(h)
    for _ in range(6):
        assert torch.equal(screened(x), want)
    assert screened.undecided > greedy_readout.UNDECIDED_LIMIT
    screened_calls = len(low_calls)
    assert screened_calls < 6  # stepped aside once the share was known
    for _ in range(2 * greedy_readout.REPROBE_EVERY):
        assert torch.equal(screened(x), want)
    assert len(low_calls) - screened_calls == 2  # the probes


def race_offsets_for(shape, vocab: int, temperature: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counter-based noise E [*shape, V] and the offsets -T log E that make an argmax the race winner."""
    rows = int(torch.tensor(shape).prod())
    noise = exponential_noise(torch.arange(rows) + seed, torch.zeros(rows, dtype=torch.long), 1, vocab)[:, 0]
    noise = noise.reshape(*shape, vocab)
    return noise, race_offsets(noise.reshape(-1, 1, vocab), torch.full((rows,), temperature)).reshape(noise.shape)


@torch.inference_mode()
def test_screened_race_is_the_fp32_race(pair):
    """Sampled rows under counter-based noise: argmax(fp32 logits - T log E), the winner of the race on
    softmax(logits / T), through the bf16 copy; on real hidden states at three temperatures, and on near-ties
    between two tokens' scores that the bf16 logits alone order wrongly."""
    target, tokenizer, _ = pair
    lm_head = target.lm_head
    screened = ScreenedArgmax(lm_head)
    prompts = [tokenizer.encode(p.text) for spec in ("default", "ood-code") for p in load_prompts(spec, 4)]
    hidden = torch.cat([target.model(torch.tensor([p])).last_hidden_state[0] for p in prompts])
    logits = lm_head(hidden)
    for seed, temperature in enumerate((0.7, 1.0, 2.0)):
        noise, offsets = race_offsets_for(hidden.shape[:1], lm_head.out_features, temperature, 1000 * seed)
        want = race(torch.softmax(logits / temperature, dim=-1), noise)
        assert torch.equal(torch.argmax(logits + offsets, dim=-1), want)
        assert torch.equal(screened(hidden, offsets), want)
        x = hidden.reshape(-1, 4, hidden.shape[-1])[:8]  # leading dimensions
        assert torch.equal(screened(x, offsets[:32].reshape(8, 4, -1)), want[:32].reshape(8, 4))
    # near-ties: hidden states whose logits for tokens a, b are 1e-4..1e-1 apart, offsets that put both on top
    weight = lm_head.weight.detach()
    x = near_ties(weight, 512, seed=3)
    logits = lm_head(x)
    pair_ids = logits.topk(2, dim=-1).indices
    _, offsets = race_offsets_for((512,), weight.shape[0], 1.0, 7)
    lead = offsets.max(dim=-1, keepdim=True).values + 5.0
    offsets.scatter_(1, pair_ids, lead.expand(-1, 2))  # a and b tie in offset: their logits decide
    want = torch.argmax(logits + offsets, dim=-1)
    bf16_choice = torch.argmax(screened.low(x.to(torch.bfloat16)).float() + offsets, dim=-1)
    assert (bf16_choice != want).sum() >= 10
    assert torch.equal(screened(x, offsets), want)
    assert torch.equal(screened(x[:MIN_ROWS - 1], offsets[:MIN_ROWS - 1]), want[:MIN_ROWS - 1])  # the full read-out


def target_race(target, prompt: list[int], params: SamplingParams) -> list[int]:
    """The target's own sampled text under the request's counter-based noise: its fp32 logits at each output
    position j, the winner of the race on softmax(logits / T) under the noise of (seed, j); no engine."""
    ids, out = list(prompt), []
    for j in range(params.max_new_tokens):
        logits = target.lm_head(target.model(torch.tensor([ids])).last_hidden_state[0, -1])
        noise = exponential_noise(torch.tensor([params.seed]), torch.tensor([j]), 1, logits.shape[-1])[0, 0]
        token = int(race(torch.softmax(logits / params.temperature, dim=-1), noise))
        out.append(token)
        ids.append(token)
    return out


@torch.inference_mode()
def test_seeded_sampling_with_the_screened_read_out_is_the_targets_own_race(pair, monkeypatch):
    """Sampled rows (beside a greedy row) whose verifies and one-token steps take their race winners through the
    screened read-out: every seeded output equals the target's own race under the same noise, with drafting and
    with plain decoding, in one batch."""
    target, tokenizer, drafter = pair
    prompts = [tokenizer.encode(p.text) for spec in ("default", "ood-code-nl") for p in load_prompts(spec, 5)]
    params = [SamplingParams(max_new_tokens=24, temperature=(0.7, 1.0, 1.3)[i % 3], seed=40 + i)
              for i in range(len(prompts))]
    greedy_prompt = tokenizer.encode(load_prompts("default", 6)[5].text)
    raced = []
    screened_call = ScreenedArgmax.__call__
    monkeypatch.setattr(ScreenedArgmax, "__call__", lambda self, x, offsets=None: raced.append(
        offsets is not None and x.reshape(-1, x.shape[-1]).shape[0] >= MIN_ROWS) or screened_call(self, x, offsets))
    wants = [target_race(target, p, q) for p, q in zip(prompts, params)]
    ids = torch.tensor([greedy_prompt])
    greedy_want = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                  pad_token_id=0)[0, len(greedy_prompt):].tolist()
    for engine in (SpecEngine(target, drafter, tokenizer, screen_greedy=True),
                   SpecEngine(target, None, tokenizer, screen_greedy=True)):
        raced.clear()
        results = engine.generate(prompts + [greedy_prompt], params + [SamplingParams(max_new_tokens=24)])
        assert [r.token_ids for r in results[:-1]] == wants
        assert results[-1].token_ids == greedy_want
        assert any(raced)  # race winners were screened
        engine.close()
