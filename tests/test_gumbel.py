"""Counter-based sampling noise (`flashdraft/engine/noise.py`) and the sampler built on it.

A sampled token depends only on (request seed, output position, the target's distribution there), so a seeded
request's text is the text plain decoding samples with the same seed: with any drafter (none, DFlash, an oracle,
a drafter of another dtype), any block size, alone or in a batch with other requests. The distribution itself is
checked by the chi-square tests in tests/test_sampling.py, which run this sampler by default.
"""

import random

import numpy as np

import pytest
import torch
from scipy.stats import kstest

from flashdraft import SamplingParams, SpecEngine
from flashdraft.engine.noise import _draws_torch, exponential, exponential_noise, mix32_, race, slot_keys
from flashdraft.engine.verify import target_probs, verify
from tiny import OracleProposer, make_drafter, make_target


def lowbias32(v: int) -> int:
    v &= 0xFFFFFFFF
    v ^= v >> 16
    v = (v * 0x7FEB352D) & 0xFFFFFFFF
    v ^= v >> 15
    v = (v * 0x846CA68B) & 0xFFFFFFFF
    return v ^ (v >> 16)


def test_mix32_is_lowbias32():
    rng = random.Random(0)
    xs = [rng.randrange(-2**31, 2**31) for _ in range(5000)] + [0, -1, 2**31 - 1, -2**31]
    got = mix32_(torch.tensor(xs, dtype=torch.int32)).tolist()
    assert [g & 0xFFFFFFFF for g in got] == [lowbias32(x) for x in xs]


def test_the_host_noise_is_the_devices_bit_for_bit():
    """On the CPU the noise is mixed in numpy (faster); on a device in torch: the same bits, so the noise a request
    sees does not depend on where it ran."""
    seeds, first = torch.tensor([7, 2**40 + 7, 123456789, 0]), torch.tensor([0, 3, 1000, 2**31 + 5])
    device_path = exponential(_draws_torch(slot_keys(seeds, first, 6), 3000, "cpu"))  # its operations, on the CPU
    assert torch.equal(exponential_noise(seeds, first, 6, 3000), device_path)


def test_noise_is_counter_based_and_exponential():
    seeds = torch.tensor([7, 7, 8, 2**40 + 7])
    noise = exponential_noise(seeds, torch.tensor([0, 3, 0, 0]), 5, 1000)
    assert noise.shape == (4, 5, 1000) and noise.dtype == torch.float32
    # output position 3 of seed 7 is the same noise whether it is slot 3 of a block from 0 or slot 0 from 3
    assert torch.equal(noise[0, 3], noise[1, 0]) and torch.equal(noise[0, 4], noise[1, 1])
    assert torch.equal(noise, exponential_noise(seeds, torch.tensor([0, 3, 0, 0]), 5, 1000))
    # other seeds (also ones that differ only in their high 32 bits) and other positions: other noise
    assert not torch.equal(noise[0, 0], noise[2, 0]) and not torch.equal(noise[0, 0], noise[3, 0])
    assert not torch.equal(noise[0, 0], noise[0, 1])
    flat = noise.flatten().double()
    assert kstest(flat.numpy(), "expon").pvalue > 1e-3
    a, b = noise[0, 0].double(), noise[2, 0].double()
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.1


def test_the_top_draw_never_lets_a_token_of_probability_zero_win():
    """The top 24-bit draw's uniform rounds to 1 in float32, whose -log is -0.0: a race divided by it, and a token
    outside top-k / top-p or whose probability underflowed won (0 / -0 is NaN, the maximum to argmax) at 1 in
    2^24 / V positions (~1 in 2,000 at vocabulary 8,192; ~1 in 110 at 152k)."""
    top = exponential(torch.tensor([2.0**24 - 1, 2.0**24 - 2, 0.0]))
    assert (top > 0).all() and float(top[0]) == 2.0**-25 and float(top[0]) < float(top[1])
    g = torch.Generator().manual_seed(0)
    rows, vocab = 256, 500
    logits = torch.randn(rows, vocab, generator=g) * 3
    draws = torch.randint(0, 2**24, (rows, vocab), generator=g).float()
    banned = logits.argsort(dim=-1)[:, :10]  # outside every top-k below, and far down at a low temperature
    draws.scatter_(1, banned[:, :1], 2.0**24 - 1)  # one banned token per row takes the top draw
    noise = exponential(draws)
    for probs in (target_probs(logits, 1.0, top_k=20), target_probs(logits, 1.0, top_p=0.5),
                  target_probs(logits, 0.02)):
        winners = race(probs, noise)
        assert (probs.gather(1, winners[:, None]) > 0).all()


def test_slots_whose_keys_differ_by_less_than_the_vocabulary_get_unrelated_noise():
    """Token ids XORed straight into a slot's key made two slots whose keys differ by some d < V see the same noise
    permuted (token t at one = token t ^ d at the other), about one pair of positions in 2^32 / V: in a flat
    distribution the second's winner was the first's XOR d. Token codes (`token_codes`) leave such slots unrelated."""
    vocab, pairs = 8192, []
    for seed in range(30):
        keys = slot_keys(torch.tensor([seed]), torch.tensor([0]), 1000)[0].numpy().view(np.uint32)
        near = np.argwhere(np.triu((keys[:, None] ^ keys[None, :]) < vocab, 1))
        pairs += [(seed, int(i), int(j), int(keys[i] ^ keys[j])) for i, j in near]
    assert len(pairs) >= 10  # ~0.9 per seed
    tokens = torch.arange(vocab)
    for seed, i, j, d in pairs:
        noise = exponential_noise(torch.tensor([seed, seed]), torch.tensor([i, j]), 1, vocab)[:, 0]
        assert int((noise[1] == noise[0][tokens ^ d]).sum()) < 16  # chance: ~V^2 / 2^24 = 4 shared values
        assert int(noise[1].argmin()) != int(noise[0].argmin()) ^ d  # a flat race's winners


def test_seeds_that_share_one_positions_noise_share_no_other():
    """Two seeds whose keys coincide at one output position (found by a birthday search over 2^18 random 62-bit
    seeds, ~8 pairs expected) see unrelated noise at every other position. With the seed folded into one 32-bit
    row key first (noise version 3), such seeds shared the noise of every position: among N unseeded requests
    about N^2 / 2^33 pairs sampled identical texts for the same prompt."""
    seeds = torch.from_numpy(np.random.default_rng(0).integers(0, 2**62, 2**18, dtype=np.int64))
    at_zero = slot_keys(seeds, torch.zeros_like(seeds), 1)[:, 0].numpy()
    order = np.argsort(at_zero, kind="stable")
    same = np.flatnonzero(np.diff(at_zero[order]) == 0)
    pairs = [(int(order[i]), int(order[i + 1])) for i in same if seeds[order[i]] != seeds[order[i + 1]]]
    assert len(pairs) >= 2
    for a, b in pairs:
        keys = slot_keys(seeds[[a, b]], torch.zeros(2, dtype=torch.long), 64)
        assert keys[0, 0] == keys[1, 0] and int((keys[0, 1:] == keys[1, 1:]).sum()) == 0
    noise = exponential_noise(seeds[list(pairs[0])], torch.tensor([1, 1]), 32, 256)
    assert int((noise[0] == noise[1]).sum()) < 8  # by chance: 8,192 / 2^24 expected


def test_race_samples_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    seeds = torch.arange(20000)
    winners = race(probs, exponential_noise(seeds, torch.zeros_like(seeds), 1, 4)[:, 0])
    freq = torch.bincount(winners, minlength=4).double() / len(seeds)
    assert torch.allclose(freq, probs.double(), atol=0.012)


def test_noise_keys_are_lowbias32_of_seed_and_position():
    """The per-position keys (hashed in numpy) are lowbias32 of the seed's two halves, each mixed with the position,
    as written out in plain Python here, for extreme seeds and positions too."""
    g = torch.Generator().manual_seed(1)
    for trial in range(100):
        rows, width = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 17, (1,), generator=g))
        seeds = torch.randint(0, 2**62, (rows,), generator=g) * (1 + trial % 2)
        seeds[0] = (2**63 - 1, 0, 2**32 - 1, 2**32)[trial % 4]
        first = torch.randint(0, 3000, (rows,), generator=g)
        first[-1] = (0, 2**31 - 1, 2**31, 2**33 + 5)[trial % 4]
        want = []
        for seed, start in zip(seeds.tolist(), first.tolist()):
            low, high = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
            positions = [(start + i) & 0xFFFFFFFF for i in range(width)]
            want.append([lowbias32(lowbias32(low ^ lowbias32(p)) ^ lowbias32(high ^ lowbias32(p ^ 0x5BD1E995)))
                         for p in positions])
        got = slot_keys(seeds, first, width)
        assert got.dtype == torch.int32 and [[k & 0xFFFFFFFF for k in row] for row in got.tolist()] == want


def test_small_batches_hash_their_keys_in_python_with_the_same_bits(monkeypatch):
    """Up to PYTHON_KEYS slots are hashed in Python integers, more in numpy: the same keys either way, negative and
    extreme seeds included."""
    from flashdraft.engine import noise

    g = torch.Generator().manual_seed(2)
    for trial in range(60):
        rows, width = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        seeds = torch.randint(-2**62, 2**62, (rows,), generator=g) * (1 + trial % 3)
        seeds[0] = (2**63 - 1, -2**63, -1, 2**32, 0)[trial % 5]
        first = torch.randint(0, 3000, (rows,), generator=g)
        first[-1] = (0, 2**31, 2**32 - 3, 2**33 + 5, 7)[trial % 5]
        in_python = noise._slot_keys_python(seeds, first, width)
        monkeypatch.setattr(noise, "PYTHON_KEYS", 0)
        in_numpy = slot_keys(seeds, first, width)
        monkeypatch.undo()
        assert in_python.dtype == in_numpy.dtype == torch.int32 and torch.equal(in_python, in_numpy)
    assert noise.PYTHON_KEYS >= 1  # one row's one position, a plain step's noise, takes the Python path


@pytest.mark.parametrize("vocab,trials", [(300, 20), (8192, 3)])
def test_a_batch_verifies_every_row_as_it_would_alone(vocab, trials):
    """Rows are verified together: greedy rows and rows racing on softmax(logits / T) at once, rows with top-k /
    top-p through `target_probs` together; each row's verdict is the one it gets alone, token for token. At 8,192
    tokens the numpy paths run, and top-p's prefix ends among the 1,024 most probable tokens, past them (T = 3) and
    among underflowed zeros (T = 0.1)."""
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(), _sampled(1), _sampled(2, temperature=0.6), _sampled(3, top_k=5),
              SamplingParams(), _sampled(4, top_p=0.8), _sampled(5, temperature=1.7), _sampled(6, temperature=3.0,
              top_p=0.95), _sampled(7, temperature=0.1, top_p=0.9), _sampled(8, top_k=40, top_p=0.8),
              _sampled(9, min_p=0.05), _sampled(10, temperature=0.7, min_p=0.2, top_k=40)]
    b, k = len(params), 6
    for trial in range(trials):
        logits = torch.randn(b, k + 1, vocab, generator=g) * 3
        noise = exponential_noise(torch.arange(b) + 100 * trial, torch.zeros(b, dtype=torch.long), k + 1, vocab)
        chosen = [logits[r].argmax(-1) if p.greedy else race(target_probs(logits[r], p.temperature, p.top_p, p.top_k,
                                                                           p.min_p), noise[r])
                  for r, p in enumerate(params)]
        drafts = torch.stack([c[:k] for c in chosen])  # drafts that match up to a row-dependent point
        for r in range(b):
            drafts[r, (r + trial) % (k + 1):] = (drafts[r, (r + trial) % (k + 1):] + 1) % vocab
        whole = verify(logits, drafts, params, noise=noise)
        for r in range(b):
            alone = verify(logits[r:r + 1], drafts[r:r + 1], params[r:r + 1], noise=noise[r:r + 1])
            assert int(whole.num_accepted[r]) == int(alone.num_accepted[0]) == min((r + trial) % (k + 1), k)
            assert int(whole.next_tokens[r]) == int(alone.next_tokens[0])


PROMPTS = [[3, 4, 5, 6], [10, 11], [20, 21, 22, 23, 24, 25, 26], [40]]


def _sampled(seed, temperature=1.0, max_new=24, **kw):
    return SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=seed, **kw)


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "olmo2"])  # fast paths (Gemma 2: capped, windowed), generic
def test_seeded_output_is_plain_decodings_whatever_the_drafter_block_or_batch(arch):
    target = make_target(arch)
    params = [_sampled(100 + i, temperature=[1.0, 0.7, 1.3, 1.0][i], top_k=[0, 0, 20, 0][i],
                       top_p=[1.0, 0.9, 1.0, 1.0][i]) for i in range(len(PROMPTS))]
    plain = [SpecEngine(target).generate([p], [q])[0].token_ids for p, q in zip(PROMPTS, params)]
    extra_prompts, extra_params = [[7, 8, 9], [50, 51]], [SamplingParams(max_new_tokens=24), _sampled(None)]
    refs = [p + o for p, o in zip(PROMPTS, plain)] + [
        p + SpecEngine(target).generate([p], [q])[0].token_ids for p, q in zip(extra_prompts, extra_params)]
    engines = {
        "dflash-b4": SpecEngine(target, make_drafter(target, block_size=4)),
        "dflash-b8": SpecEngine(target, make_drafter(target, block_size=8)),
        "dflash-fp32-drafter": SpecEngine(target, make_drafter(target, block_size=4, dtype=torch.float32)),
        "dflash-bf16-drafter": SpecEngine(target, make_drafter(target, block_size=4, dtype=torch.bfloat16)),
        # the fixed policy: the oracle drafts every cycle (the others run the default, adaptive one)
        "oracle-b6": SpecEngine(target, block_size=6, proposer=OracleProposer(refs, corrupt=0.5, seed=3),
                                draft_policy="fixed"),
        "plain-batched": SpecEngine(target),
    }
    for name, engine in engines.items():
        alone = [engine.generate([p], [q])[0].token_ids for p, q in zip(PROMPTS, params)]
        assert alone == plain, name
        # in one batch with each other, plus a greedy row and an unseeded sampled row around them
        batch = engine.generate(PROMPTS + extra_prompts, params + extra_params)
        assert [r.token_ids for r in batch[:len(PROMPTS)]] == plain, name
    oracle = engines["oracle-b6"].generate(PROMPTS, params)
    assert sum(r.stats.num_accepted_tokens for r in oracle) > 30  # the oracle's drafts really were accepted


def test_greedy_rows_draft_while_sampled_rows_step():
    """Drafting rows all greedy, a sampled row of the same batch at one-token steps (the policy's choice under load
    or after failed drafts): the greedy rows draft their argmax and every row's text is plain decoding's."""
    target = make_target("qwen3")
    params = [SamplingParams(max_new_tokens=20), _sampled(5, max_new=20), SamplingParams(max_new_tokens=20)]
    prompts = PROMPTS[:3]
    plain = [SpecEngine(target).generate([p], [q])[0].token_ids for p, q in zip(prompts, params)]
    engine = SpecEngine(target, make_drafter(target, block_size=4))
    batch = engine.open_batch()
    batch.policy.widths = lambda rows, pending=None: [1 if r.sampled else 4 for r in rows]
    events = list(engine.add(batch, prompts, params))
    while batch.rows:
        events += engine.step(batch)
    results = {e.index: e.result for e in events if e.finished}
    assert [results[i].token_ids for i in range(3)] == plain
    assert results[0].stats.acceptance_lengths and results[2].stats.acceptance_lengths  # the greedy rows drafted
    assert not results[1].stats.acceptance_lengths and results[1].stats.plain_steps  # the sampled row stepped


def test_sampled_text_depends_on_the_seed_and_unseeded_requests_differ():
    target = make_target("qwen3")
    engine = SpecEngine(target, make_drafter(target, block_size=4))
    a, b = (engine.generate([PROMPTS[0]], _sampled(s, max_new=32))[0].token_ids for s in (1, 2))
    assert a != b
    c, d = (engine.generate([PROMPTS[0]], _sampled(None, max_new=32))[0].token_ids for _ in range(2))
    assert c != d


def test_shared_noise_raises_acceptance_over_rejection_sampling():
    """A drafter close to the target: under shared noise its drafts are the target's samples far more often than
    argmax drafts survive rejection sampling (the reason the coupled sampler is the default)."""
    target = make_target("qwen3")
    taus = {}
    for sampler in ("gumbel", "rejection"):
        engine = SpecEngine(target, block_size=4, sampler=sampler,
                            proposer=_NoisyTargetProposer(target, sampler == "gumbel"))
        res = engine.generate(PROMPTS * 4, [_sampled(i, max_new=40) for i in range(16)])
        taus[sampler] = sum(r.stats.num_accepted_tokens for r in res) / sum(r.stats.num_drafts for r in res) + 1
    assert taus["gumbel"] > taus["rejection"] + 0.5, taus
    assert taus["gumbel"] == pytest.approx(4.0)  # a drafter equal to the target is always right under shared noise


class _NoisyTargetProposer:
    """Drafts from the target's own next-token distribution after each committed prefix (an ideal drafter of one
    token per position, run autoregressively): with the shared noise it proposes exactly the target's samples;
    without it, its argmax."""

    needs_features, needs_histories = False, True

    def __init__(self, target, use_noise):
        self.target, self.use_noise = target, use_noise

    def new_batch_state(self, buckets=None, page_size=None, max_pages=None):
        from flashdraft.engine import NoRowState

        return NoRowState()

    def propose(self, state, inp, block_size):
        from flashdraft.engine.verify import target_probs

        drafts = []
        for row, history in enumerate(inp.histories):
            seq = list(history)
            for j in range(block_size - 1):
                with torch.no_grad():
                    logits = self.target(torch.tensor([seq])).logits[0, -1]
                if self.use_noise and inp.noise is not None:
                    token = int(race(target_probs(logits, float(inp.temperatures[row])), inp.noise[row, j]))
                else:
                    token = int(logits.argmax())
                seq.append(token)
            drafts.append(seq[len(history):])
        return torch.tensor(drafts, dtype=torch.long), None


def test_greedy_rows_ignore_the_sampler():
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    greedy = SamplingParams(max_new_tokens=20)
    outs = [SpecEngine(target, drafter, sampler=s).generate(PROMPTS, greedy) for s in ("gumbel", "rejection")]
    assert [r.token_ids for r in outs[0]] == [r.token_ids for r in outs[1]]
    with pytest.raises(ValueError, match="sampler must be one of"):
        SpecEngine(target, drafter, sampler="bogus")


@pytest.mark.skipif(__import__("flashdraft.engine.compiled", fromlist=["x"]).compile_unavailable(torch.device("cpu"))
                    is not None, reason="no C++ compiler for torch.compile")
def test_compiled_engine_samples_plain_decodings_text():
    target = make_target("qwen3", dtype=torch.float32)
    drafter = make_drafter(target, block_size=4, dtype=torch.float32)
    params = [_sampled(200 + i) for i in range(3)]
    plain = SpecEngine(target, exact=True).generate(PROMPTS[:3], params)
    compiled = SpecEngine(target, drafter, compile=True).generate(PROMPTS[:3], params)
    assert [r.token_ids for r in compiled] == [r.token_ids for r in plain]


def test_bf16_exact_mode_samples_plain_decodings_text_in_any_batch():
    """In bf16 a verify block and a one-token step round differently; exact mode makes the sampled text, like the
    greedy one, bit-identical to plain decoding's, alone and in a batch."""
    target = make_target("qwen3", dtype=torch.bfloat16)
    drafter = make_drafter(target, block_size=4, dtype=torch.bfloat16)
    params = [_sampled(300 + i) for i in range(len(PROMPTS))]
    plain = [SpecEngine(target, exact=True).generate([p], [q])[0].token_ids for p, q in zip(PROMPTS, params)]
    spec = SpecEngine(target, drafter, exact=True)
    assert [spec.generate([p], [q])[0].token_ids for p, q in zip(PROMPTS, params)] == plain
    assert [r.token_ids for r in spec.generate(PROMPTS, params)] == plain


@pytest.mark.parametrize("screen", [True, False])  # the race read out by the target's screened argmax, or verified
def test_noise_made_on_its_own_thread_leaves_seeded_text_unchanged(screen, monkeypatch):
    """Where no sampled row drafts, the noise (and the race offsets of a screened read-out) is made on a thread of
    its own while the target runs (`EngineConfig.noise_thread`): the same text as plain decoding made inline, in
    a batch with greedy rows that draft, and the thread really made it."""
    target = make_target("qwen3", dtype=torch.float32 if screen else torch.float64)  # the read-out screens fp32
    monkeypatch.setattr("flashdraft.engine.generate.NOISE_THREAD_MIN_VALUES", 0)  # a tiny vocabulary's noise too
    params = [SamplingParams(max_new_tokens=20), _sampled(5, max_new=20), _sampled(6, temperature=0.7, max_new=20),
              _sampled(None, top_p=1.0 if screen else 0.9, max_new=20)]  # top-p: the verifier races, not the read-out
    plain_engine = SpecEngine(target, noise_thread=False, screen_greedy=screen)
    plain = [plain_engine.generate([p], [q])[0].token_ids for p, q in zip(PROMPTS[:3], params[:3])]
    engine = SpecEngine(target, make_drafter(target, block_size=4, dtype=target.dtype), noise_thread=True,
                        screen_greedy=screen)
    batch = engine.open_batch()
    batch.policy.widths = lambda rows, pending=None: [1 if r.sampled else 4 for r in rows]
    events = list(engine.add(batch, PROMPTS, params))
    submitted = []
    worker = engine._noise_thread()
    submit = worker.submit
    worker.submit = lambda *a: submitted.append(a) or submit(*a)
    while batch.rows:
        events += engine.step(batch)
    results = {e.index: e.result for e in events if e.finished}
    assert [results[i].token_ids for i in range(3)] == plain
    assert results[0].stats.acceptance_lengths  # the greedy row drafted beside the sampled rows' steps
    assert len(submitted) >= 19  # every cycle's noise (and, screened, its offsets) came from the thread
    assert (engine.fast.screened is not None) == screen
    assert SpecEngine(target, noise_thread=False)._noise_thread() is None


@torch.inference_mode()
def test_noise_hashed_ahead_is_the_targets_own_race(monkeypatch):
    """Sampled rows hash the noise of several positions at once and reuse it at later steps (`NOISE_AHEAD`): each
    seeded text is still the target's own race under (seed, position) noise, computed here without an engine, at
    one-token steps alone, drafting, and two rows together; and the engine really hashed fewer windows than it took."""
    import flashdraft.engine.generate as generate_module

    target = make_target("qwen3")
    params = [_sampled(11, max_new=20), _sampled(12, temperature=0.7, max_new=20)]
    prompts = PROMPTS[:2]
    reference = []
    for prompt, q in zip(prompts, params):
        ids, out = list(prompt), []
        for j in range(q.max_new_tokens):
            logits = target(torch.tensor([ids])).logits[0, -1].float()
            noise = exponential_noise(torch.tensor([q.seed]), torch.tensor([j]), 1, logits.shape[-1])[0, 0]
            out.append(int(race(torch.softmax(logits / q.temperature, dim=-1), noise)))
            ids.append(out[-1])
        reference.append(out)
    hashed = []
    monkeypatch.setattr(generate_module, "exponential_noise",
                        lambda *a, **k: hashed.append(a[2]) or exponential_noise(*a, **k))
    plain = SpecEngine(target)
    assert [plain.generate([p], [q])[0].token_ids for p, q in zip(prompts, params)] == reference
    assert len(hashed) < 8 and max(hashed) == generate_module.NOISE_AHEAD  # 40 positions in a few windows
    assert [r.token_ids for r in plain.generate(prompts, params)] == reference
    spec = SpecEngine(target, make_drafter(target, block_size=4))
    assert [spec.generate([p], [q])[0].token_ids for p, q in zip(prompts, params)] == reference
    assert [r.token_ids for r in spec.generate(prompts, params)] == reference


@pytest.mark.parametrize("screen", [True, False])
def test_min_p_rows_race_on_the_restricted_distribution(screen):
    """A seeded min-p row's text is the race, under its noise, on the target's distribution restricted by min-p
    (`target_probs`), computed here one forward per token without an engine; with the screened read-out the row
    is raced by the verifier, not read out as if unrestricted. Beside a greedy row and a plain sampled row."""
    target = make_target("qwen3", dtype=torch.float32 if screen else torch.float64)
    q = _sampled(21, temperature=1.0, min_p=0.4, max_new=16)

    @torch.inference_mode()
    def raced(min_p: float) -> list[int]:
        out, ids = [], list(PROMPTS[0])
        for j in range(q.max_new_tokens):
            logits = target(torch.tensor([ids])).logits[0, -1].float()
            noise = exponential_noise(torch.tensor([q.seed]), torch.tensor([j]), 1, logits.shape[-1])[0, 0]
            out.append(int(race(target_probs(logits, q.temperature, min_p=min_p), noise)))
            ids.append(out[-1])
        return out

    expected = raced(q.min_p)
    assert expected != raced(0.0)  # the restriction shows in the text
    for drafter in (None, make_drafter(target, block_size=4, dtype=target.dtype)):
        engine = SpecEngine(target, drafter, screen_greedy=screen)
        got = engine.generate(PROMPTS[:3], [q, SamplingParams(max_new_tokens=16), _sampled(22, max_new=16)])
        assert got[0].token_ids == expected, drafter is not None
        assert (engine.fast.screened is not None) == screen
