"""Token trees (`engine/tree.py`, `verify.verify_tree`, `SpecEngine(tree_budget=...)`) are lossless.

- Construction: `best_first` against brute force (every path of a small candidate table, sorted by path
  log-probability): its nodes are exactly the top N, in order, each parent before its children; `chain`;
  `candidate_lists`. The ancestor matrix and the tree attention mask of a hand-built tree, context included.
- The walk: on a chain-shaped tree `verify_tree` is `verify` (greedy and counter-based noise rows); on random
  trees it agrees with `verify` over every root-to-leaf chain of the tree; a hand-built tree whose accepted path
  runs through third and second siblings.
- The engine: greedy output equals `target.generate(do_sample=False)` on four fast-path architectures, batches of
  uneven prompts, budgets 4/16/40/"auto", fixed and adaptive draft policies, a long generation and continuous
  batching; an oracle drafter places the target's true continuation at chosen candidate ranks (first, second,
  third sibling, deep, absent), and each cycle's acceptance must be exactly what the brute-force top N of its
  candidate table implies. After every cycle the target's cache and the drafter's context (written or pending)
  hold exactly the committed tokens' K/V and features (compared with a fresh forward over them).
- Sampling: seeded output under counter-based noise equals plain decoding's with the same seed, alone and in a
  mixed batch (so its distribution is plain decoding's, which tests/test_sampling.py checks); chi-square fits of
  the engine's samples with trees against the target's exact distribution (the first two tokens jointly, each
  position's marginal, each position's transitions from the previous token), rejection sampling at temperature 1
  and with top-k/top-p, the noise sampler with top-k/top-p; a walk broken by one node (each node judged by its
  parent's logits) must fail them.
- The auto budget verifies trees larger than the block where they pay, under the adaptive policy and the fixed one
  (whose cycles feed the cost model too).
- Configuration: bad budgets raise with the option's name; compiled steps, exact mode, the generic transformers
  path and proposers without candidates warn and verify the chain, still losslessly.

What this file does not cover: prompt-lookup branches, speed, and which size the auto budget picks.
"""

import itertools
import math
import random

import pytest
import torch
from scipy.stats import chisquare
from torch.testing import assert_close
from transformers import Qwen3Config, Qwen3ForCausalLM

import flashdraft.engine.generate as engine_module
from flashdraft import DFlashDraftModel, SamplingParams, SpecEngine, make_draft_config
from flashdraft.engine import EngineConfig, NoRowState, target_probs, verify
from flashdraft.engine.compiled import compile_unavailable
from flashdraft.engine.noise import exponential_noise, race
from flashdraft.engine.policy import COST_WINDOW, CycleTiming
from flashdraft.engine.tree import (TREE_CANDIDATES, RowTree, TokenTree, best_first, candidate_lists, chain, stack,
                                    tree_attention_mask)
from flashdraft.engine.verify import verify_tree
from flashdraft.model.draft_vocab import count_tokens, restrict_drafter, select_draft_vocab
from test_sampling import (N_LONG, P_MIN, MixedWidths, conditional_probs, empirical, fit, null_total_variation,
                           per_position_pvalues)
from test_sampling import MASK as SMALL_MASK
from test_sampling import VOCAB as SMALL_VOCAB
from test_preemption import PROMPTS as PREEMPTION_PROMPTS
from test_preemption import run_with_preemption
from tiny import VOCAB, OracleProposer, cache_row, greedy_reference, make_drafter, make_target

FAST_ARCHS = ("qwen3", "llama", "mistral", "qwen2", "phi3", "gemma2", "gemma3", "gpt_oss")
_targets: dict = {}
_drafters: dict = {}
_references: dict = {}


def _target(arch):
    if arch not in _targets:
        _targets[arch] = make_target(arch)
    return _targets[arch]


def _drafter(arch, block_size=4):
    if (arch, block_size) not in _drafters:
        _drafters[arch, block_size] = make_drafter(_target(arch), block_size=block_size)
    return _drafters[arch, block_size]


def _reference(arch, prompt, max_new):
    """The target's own greedy continuation (transformers generate), cached."""
    key = (arch, tuple(prompt), max_new)
    if key not in _references:
        _references[key] = greedy_reference(_target(arch), prompt, max_new)
    return _references[key]


def _prompts(rng, batch, longest=30):
    return [[rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, longest))] for _ in range(batch)]


# ---- construction -------------------------------------------------------------------------------------------


def brute_force_top(logp, budget):
    """The `budget` most likely paths of a candidate table (tuples of candidate ranks, one per depth): every path
    of every depth enumerated, sorted by the sum of its log-probabilities."""
    paths = [p for depth in range(1, len(logp) + 1)
             for p in itertools.product(*(range(len(level)) for level in logp[:depth]))]
    paths.sort(key=lambda p: -sum(logp[d][r] for d, r in enumerate(p)))
    return paths[:budget]


def rank_paths(tree, candidates):
    """Each node's path as candidate ranks (root: ()), read off its tokens and parents."""
    paths = [()]
    for j in range(1, len(tree.tokens)):
        assert 0 <= tree.parents[j] < j, f"node {j}'s parent {tree.parents[j]} does not precede it"
        paths.append(paths[tree.parents[j]] + (candidates[tree.depths[j] - 1].index(tree.tokens[j]),))
    return paths


def random_table(seed, widths):
    """Candidate tokens (distinct per position) and sorted log-probabilities whose path sums have no near-ties."""
    rng = random.Random(seed)
    while True:
        candidates = [rng.sample(range(50), w) for w in widths]
        logp = [sorted((-rng.expovariate(1.0) * 2 for _ in range(w)), reverse=True) for w in widths]
        sums = sorted(sum(logp[d][r] for d, r in enumerate(p)) for p in brute_force_top(logp, 10 ** 6))
        if min(b - a for a, b in zip(sums, sums[1:])) > 1e-9:
            return candidates, logp


@pytest.mark.parametrize("seed,widths", [(0, (3, 2, 4, 3)), (1, (4, 4, 4)), (2, (1, 3, 1, 2, 2)), (3, (5,)),
                                         (4, (2, 2, 2, 2, 2, 2))])
def test_best_first_is_the_brute_force_top_n(seed, widths):
    candidates, logp = random_table(seed, widths)
    total = len(brute_force_top(logp, 10 ** 6))
    for budget in sorted({0, 1, 2, 3, 7, 12, total - 1, total, total + 5}):
        tree = best_first(99, candidates, logp, budget)
        nodes = min(budget, total) + 1
        assert len(tree.tokens) == len(tree.parents) == len(tree.depths) == len(tree.path_logp) == nodes
        assert (tree.tokens[0], tree.parents[0], tree.depths[0], tree.path_logp[0]) == (99, -1, 0, 0.0)
        paths = rank_paths(tree, candidates)
        # exactly the top N, in order of path probability (no ties by construction): every prefix is the top of
        # its size, and a tree (parents precede children)
        assert paths[1:] == brute_force_top(logp, budget)
        for j in range(1, nodes):
            assert tree.depths[j] == tree.depths[tree.parents[j]] + 1 == len(paths[j]) <= len(widths)
            assert tree.path_logp[j] == pytest.approx(sum(logp[d][r] for d, r in enumerate(paths[j])), abs=1e-12)
        assert all(a >= b for a, b in zip(tree.path_logp[1:], tree.path_logp[2:]))
        for m in range(1, nodes + 1):
            prefix = tree.prefix(m)
            assert rank_paths(prefix, candidates)[1:] == brute_force_top(logp, m - 1)
        expected = tree.expected_accepted()
        assert expected[0] == 0
        assert expected[-1] == pytest.approx(sum(math.exp(x) for x in tree.path_logp[1:]), rel=1e-9)


def test_best_first_edge_cases_and_chain():
    assert best_first(5, [[1, 2], [3, 4]], [[-0.1, -2.0], [-0.2, -3.0]], 0).tokens == [5]
    assert best_first(5, [], [], 10).tokens == [5]
    # budget k with one dominant candidate per position: the argmax chain
    candidates, logp = [[1, 2], [3, 4], [5, 6]], [[-0.01, -5.0], [-0.01, -5.0], [-0.01, -5.0]]
    tree = best_first(7, candidates, logp, 3)
    reference = chain(7, [1, 3, 5])
    assert (tree.tokens, tree.parents, tree.depths) == (reference.tokens, reference.parents, reference.depths)
    stacked = stack([tree, reference], "cpu")
    assert stacked.num_nodes == 4 and stacked.path_depth() == 3
    assert stacked.children()[0] == {(0, 1): 1, (1, 3): 2, (2, 5): 3}


def test_candidate_lists_are_the_sorted_top_of_the_log_softmax():
    scores = torch.randn(2, 3, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    ids, logp = candidate_lists(scores, top=4)
    reference = torch.log_softmax(scores, -1)
    for b, k in itertools.product(range(2), range(3)):
        order = reference[b, k].argsort(descending=True)[:4].tolist()
        assert ids[b][k] == order
        assert logp[b][k] == pytest.approx(reference[b, k, order].tolist(), abs=1e-6)
    assert len(candidate_lists(scores, top=50)[0][0][0]) == 20  # no more candidates than tokens


# ---- ancestors and the tree attention mask --------------------------------------------------------------------

# two hand-built trees of 7 nodes: their parents, and each node's ancestors (itself included) written out by hand
PARENTS = [[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 2, 0, 4, 0]]
DEPTHS = [[0, 1, 1, 2, 2, 2, 3], [0, 1, 2, 3, 1, 2, 1]]
ANCESTORS = [[{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 4}, {0, 2, 5}, {0, 1, 3, 6}],
             [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 4}, {0, 4, 5}, {0, 6}]]


def _hand_built_tree():
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24, 25, 26]])
    return TokenTree(tokens, torch.tensor(PARENTS), torch.tensor(DEPTHS))


def test_ancestors_of_a_hand_built_tree():
    expected = torch.tensor([[[i in ANCESTORS[r][j] for i in range(7)] for j in range(7)] for r in range(2)])
    assert torch.equal(_hand_built_tree().ancestors(), expected)


def test_tree_attention_mask_of_a_hand_built_tree():
    context, key_len = torch.tensor([2, 5]), 14  # slots past a row's tree (row 0: 9 .. 13) are never visible
    mask = tree_attention_mask(_hand_built_tree().ancestors(), context, key_len)
    assert mask.shape == (2, 1, 7, key_len) and mask.dtype == torch.bool
    for r, j in itertools.product(range(2), range(7)):
        n = int(context[r])
        expected = [s < n or (n <= s < n + 7 and s - n in ANCESTORS[r][j]) for s in range(key_len)]
        assert mask[r, 0, j].tolist() == expected, (r, j)
    # two rows written out in full: context, then the node's ancestors' scratch slots
    assert mask[0, 0, 6].int().tolist() == [1, 1, 1, 1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0]
    assert mask[1, 0, 5].int().tolist() == [1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0]


# ---- the walk -------------------------------------------------------------------------------------------------

ROW_PARAMS = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(), SamplingParams(temperature=1.0)]


def _row_noise(b, width, vocab, seed):
    """Counter-based noise [b, width, V] of each row (greedy rows: ones, as the engine passes them)."""
    noise = exponential_noise(torch.arange(b) + 1000 * seed, torch.zeros(b, dtype=torch.long), width, vocab)
    greedy = torch.tensor([p.greedy for p in ROW_PARAMS[:b]])
    return torch.where(greedy[:, None, None], torch.ones_like(noise), noise)


def _target_choices(logits, noise):
    """Each row's own token at every position: its argmax, or its race winner under the row's noise."""
    return torch.stack([logits[r].argmax(-1) if p.greedy else race(
        target_probs(logits[r], p.temperature, p.top_p, p.top_k), noise[r]) for r, p in enumerate(ROW_PARAMS)])


def test_verify_tree_on_a_chain_is_verify():
    gen = torch.Generator().manual_seed(0)
    b, k, vocab = len(ROW_PARAMS), 5, 20
    seen = set()
    for trial in range(30):
        logits = torch.randn(b, k + 1, vocab, generator=gen, dtype=torch.float64) * 3
        for noise in (None, _row_noise(b, k + 1, vocab, trial)):
            params = ROW_PARAMS if noise is not None else [SamplingParams()] * b
            chosen = logits.argmax(-1) if noise is None else _target_choices(logits, noise)
            drafts = chosen[:, :k].clone()
            for r in range(b):  # each row rejected at a random position (or nowhere)
                j = int(torch.randint(0, k + 1, (1,), generator=gen))
                if j < k:
                    drafts[r, j] = (drafts[r, j] + 1) % vocab
            plain = verify(logits, drafts, params, noise=noise)
            tree = stack([chain(7, drafts[r].tolist()) for r in range(b)], "cpu")
            walked = verify_tree(logits, tree, params, noise=noise)
            assert torch.equal(walked.num_accepted, plain.num_accepted)
            assert torch.equal(walked.next_tokens, plain.next_tokens)
            assert walked.paths == [list(range(a + 1)) for a in plain.num_accepted.tolist()]
            seen.update(plain.num_accepted.tolist())
    assert seen == set(range(k + 1))


def _leaf_paths(tree: TokenTree, row: int):
    parents = tree.parents[row].tolist()
    leaves = set(range(len(parents))) - set(parents)
    paths = []
    for leaf in sorted(leaves):
        path = [leaf]
        while path[-1] != 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


def test_verify_tree_agrees_with_verify_on_every_root_to_leaf_chain():
    """On random trees: a chain along any root-to-leaf path accepts at most the walk's path, and a chain through
    the walk's path accepts exactly it and names the same next token (greedy and noise rows)."""
    gen = torch.Generator().manual_seed(1)
    b, vocab, depths_seen = len(ROW_PARAMS), 6, []
    for trial in range(25):
        rows = []
        for r in range(b):
            candidates = [torch.randperm(vocab, generator=gen)[:3].tolist() for _ in range(4)]
            logp = [sorted(torch.randn(3, generator=gen).tolist(), reverse=True) for _ in range(4)]
            rows.append(best_first(0, candidates, logp, 30))
        tree = stack(rows, "cpu")
        logits = torch.randn(b, tree.num_nodes, vocab, generator=gen, dtype=torch.float64) * 2
        noise = _row_noise(b, 5, vocab, trial)
        walked = verify_tree(logits, tree, ROW_PARAMS, noise=noise)
        for r in range(b):
            walk, a, nxt = walked.paths[r], int(walked.num_accepted[r]), int(walked.next_tokens[r])
            assert len(walk) == a + 1 and walk[0] == 0
            depths_seen.append(a)
            through = 0
            for path in _leaf_paths(tree, r):
                chain_logits = logits[r, path][None]
                drafts = tree.tokens[r, path[1:]][None]
                verdict = verify(chain_logits, drafts, [ROW_PARAMS[r]], noise=noise[r, :len(path)][None])
                accepted = int(verdict.num_accepted[0])
                assert accepted <= a and path[:accepted + 1] == walk[:accepted + 1]
                if path[:a + 1] == walk:
                    through += 1
                    assert (accepted, int(verdict.next_tokens[0])) == (a, nxt)
            assert through >= 1
    assert max(depths_seen) >= 3 and min(depths_seen) == 0


def test_greedy_walk_follows_the_argmax_through_later_branches():
    # root (token 1) -> children 5, 7, 9 (nodes 1, 2, 3); node 1 (5) -> 9 (node 6, a decoy: the same token under
    # another parent); node 3 (9) -> 2, 3 (nodes 4, 5); node 5 (3) -> 4 (node 7)
    parents = [-1, 0, 0, 0, 3, 3, 1, 5]
    depths = [0, 1, 1, 1, 2, 2, 2, 3]
    tokens = [1, 5, 7, 9, 2, 3, 9, 4]
    argmax = [9, 9, 0, 3, 0, 4, 0, 8]  # the target's argmax at each node
    vocab = 12
    logits = torch.randn(2, 8, vocab, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logits[0, torch.arange(8), torch.tensor(argmax)] += 20.0
    logits[1] = logits[0]
    logits[1, 0, 11] += 100.0  # the second row's target wants a token the root has no child for
    tree = TokenTree(torch.tensor([tokens] * 2), torch.tensor([parents] * 2), torch.tensor([depths] * 2))
    for params, noise in (([SamplingParams()] * 2, None),
                          ([SamplingParams(temperature=0.05)] * 2, exponential_noise(
                              torch.tensor([3, 4]), torch.zeros(2, dtype=torch.long), 4, vocab))):
        verdict = verify_tree(logits, tree, params, noise=noise)
        assert verdict.paths == [[0, 3, 5, 7], [0]]
        assert verdict.num_accepted.tolist() == [3, 0] and verdict.next_tokens.tolist() == [8, 11]


# ---- oracle drafting: every path shape --------------------------------------------------------------------------


class TreeOracle:
    """A drafting method that knows each request's true continuation (references[request id] = prompt + the
    target's own tokens) and offers candidate lists holding it at the ranks `ranks(request id, history length)`
    gives (one per draft position; None: absent), beside filler tokens, with fixed per-position log-probabilities.
    With `budget` it records, per request and cycle, the acceptance the brute-force top `budget` paths of its own
    table imply: the deepest prefix of the true path among them (the greedy walk follows the target, so it goes
    exactly as deep as the tree holds the truth)."""

    needs_features = False
    needs_histories = True

    def __init__(self, references, ranks, width=3, budget=None, seed=0):
        self.references, self.ranks, self.budget = references, ranks, budget
        self.width = width if callable(width) else (lambda req: width)  # candidates per position, per request
        rng = random.Random(seed)
        self.logp = [sorted((-rng.expovariate(1.0) * 2 for _ in range(8)), reverse=True) for _ in range(16)]
        self.expected: dict = {}
        self.ranks_used: dict = {}

    def new_batch_state(self, buckets=None, page_size=None, max_pages=None):
        return NoRowState()

    def propose(self, state, inp, block_size):
        """The chain ("auto" verifies it in some cycles): each position's first candidate."""
        ids, _ = self.propose_candidates(state, inp, block_size, TREE_CANDIDATES)
        return torch.tensor([[cands[0] for cands in row] for row in ids], device=inp.bonus.device), None

    def propose_candidates(self, state, inp, block_size, top):
        k = block_size - 1
        ids, logp = [], []
        for req, history in zip(inp.request_ids, inp.histories):
            n, width = len(history), self.width(req)
            assert top >= width
            ref = self.references[req]
            truth = ref[n:n + k] if ref[:n] == history and len(ref) >= n + k else None
            ranks = self.ranks(req, n) if truth is not None else [None] * k
            rng = random.Random(hash((req, n)))
            row = []
            for d in range(k):
                fillers = [t for t in rng.sample(range(VOCAB), width + 1) if truth is None or t != truth[d]]
                cands = fillers[:width]
                if ranks[d] is not None and ranks[d] < width:
                    cands = fillers[:ranks[d]] + [truth[d]] + fillers[ranks[d]:width - 1]
                row.append(cands)
            ids.append(row)
            table = [level[:width] for level in self.logp[:k]]
            logp.append(table)
            if truth is not None and self.budget is not None:
                top_paths = set(brute_force_top(table, self.budget))
                depth = 0
                while depth < k and ranks[depth] is not None and tuple(ranks[:depth + 1]) in top_paths:
                    depth += 1
                self.expected.setdefault(req, []).append(depth)
                self.ranks_used.setdefault(req, []).append(tuple(ranks[:depth]))
        return ids, logp


def _random_ranks(weights=(0.45, 0.25, 0.15, 0.15), seed=0):
    """Per (request, history length) a rank for every position: 0, 1, 2 or absent."""

    def ranks(req, n):
        rng = random.Random(hash((seed, req, n)))
        return [rng.choices([0, 1, 2, None], weights)[0] for _ in range(16)]

    return ranks


ORACLE_CASES = {  # name: (ranks(req, n), tree budget)
    "first": (lambda req, n: [0] * 16, 4),
    "second-everywhere-full-tree": (lambda req, n: [1] * 16, 120),  # width 3, depth 4: all 120 nodes
    "second-everywhere-small-budget": (lambda req, n: [1] * 16, 9),
    "third-then-second": (lambda req, n: [2, 1, 2, 1] + [0] * 12, 120),
    "absent-at-depth-1": (lambda req, n: [None] * 16, 40),
    "absent-at-depth-3": (lambda req, n: [1, 2, None, 0] + [0] * 12, 120),
    "random-shapes": (_random_ranks(), 40),
    "random-shapes-budget-8": (_random_ranks(seed=1), 8),
}


@pytest.mark.parametrize("name", ORACLE_CASES)
def test_oracle_trees_accept_exactly_what_the_tree_holds(name):
    ranks, budget = ORACLE_CASES[name]
    arch, block_size, max_new = "qwen3", 5, 36
    rng = random.Random(name)
    prompts = _prompts(rng, 3)
    references = [p + _reference(arch, p, max_new + block_size) for p in prompts]
    oracle = TreeOracle(references, ranks, budget=budget, seed=len(name))
    engine = SpecEngine(_target(arch), block_size=block_size, proposer=oracle, tree_budget=budget,
                        draft_policy="fixed")
    results = engine.generate(prompts, SamplingParams(max_new_tokens=max_new))
    k = block_size - 1
    for req, (res, prompt) in enumerate(zip(results, prompts)):
        assert res.token_ids == _reference(arch, prompt, max_new), f"{name} row {req}"
        implied = oracle.expected[req]
        assert [a - 1 for a in res.stats.acceptance_lengths] == implied, f"{name} row {req}"
        assert res.stats.verify_widths == [budget + 1] * len(implied)
    implied = [a for req in oracle.expected.values() for a in req]
    if name == "second-everywhere-full-tree":  # the truth as every position's second candidate: full depth
        assert set(implied) == {k}
    if name == "second-everywhere-small-budget":
        assert max(implied) < k
    if name.startswith("absent-at-depth-1"):
        assert set(implied) == {0}
    if name.startswith("absent-at-depth-3"):
        assert set(implied) == {2}
    if name == "third-then-second":
        assert set(implied) == {k}
    if name == "random-shapes":  # every depth, and accepted paths through second and third siblings
        assert set(implied) == set(range(k + 1))
        used = {r for req in oracle.ranks_used.values() for path in req for r in path}
        assert used == {0, 1, 2}


def test_oracle_trees_in_batches_with_uneven_rows_and_auto_budget():
    """Rows of different prompt lengths and tree sizes in one forward (the middle row, one candidate per
    position, verifies a chain of 8 nodes between the other two rows' trees of 14: a group of rows that are not
    contiguous in the cache; the adaptive policy adds one-token steps), the auto budget, every architecture with a
    fast path."""
    combos = [("auto", "adaptive"), (13, "adaptive"), ("auto", "fixed"), (13, "fixed")]
    for i, (arch, (budget, policy)) in enumerate(zip(FAST_ARCHS, combos)):
        rng = random.Random(50 + i)
        prompts = _prompts(rng, 3)
        max_new = rng.randint(20, 32)
        references = [p + _reference(arch, p, max_new + 8) for p in prompts]
        oracle = TreeOracle(references, _random_ranks(seed=i), width=lambda req: [3, 1, 2][req])
        engine = SpecEngine(_target(arch), block_size=8, proposer=oracle, tree_budget=budget, draft_policy=policy)
        results = engine.generate(prompts, SamplingParams(max_new_tokens=max_new))
        for row, (res, prompt) in enumerate(zip(results, prompts)):
            assert res.token_ids == _reference(arch, prompt, max_new), (arch, budget, policy, row)
        if policy == "fixed":
            assert sum(r.stats.num_accepted_tokens for r in results) > max_new


# ---- greedy losslessness with the DFlash drafter -------------------------------------------------------------


def rig(engine, references, ranks):
    """Make the engine's own DFlash proposer move the true continuation (references[request id]) to rank
    `ranks(request id, history length)[d]` of its real candidates at each position d (None: remove it), so that
    trees accept deep paths through later siblings while the drafter's features and context are the real ones."""
    proposer = engine.proposer
    real = proposer.propose_candidates
    proposer.needs_histories = True

    def rigged(state, inp, block_size, top):
        ids, logp = real(state, inp, block_size, top)
        for row, (req, history) in enumerate(zip(inp.request_ids, inp.histories)):
            ref, n = references[req], len(history)
            if ref[:n] != history:
                continue
            for d, (truth, rank) in enumerate(zip(ref[n:n + block_size - 1], ranks(req, n))):
                cands = [c for c in ids[row][d] if c != truth]
                if rank is not None:
                    cands.insert(rank, truth)
                ids[row][d] = cands[:len(ids[row][d])]
        return ids, logp

    proposer.propose_candidates = rigged
    return engine


GREEDY_CASES = [(arch, budget, policy) for (budget, policy), arch in
                zip(itertools.product((4, 16, 40, "auto"), ("fixed", "adaptive")), itertools.cycle(FAST_ARCHS))]


@pytest.mark.parametrize("arch,budget,policy", GREEDY_CASES)
def test_greedy_trees_equal_target(arch, budget, policy):
    """Batches of uneven prompts, half the cases with a stop id the target really produces and small cache
    chunks (the caches grow during the run), with the DFlash drafter as it is and rigged to hold the truth deep in
    its trees."""
    rng = random.Random(str((arch, budget, policy)))
    prompts = _prompts(rng, 3, longest=40)
    max_new = rng.randint(16, 40)
    runs = [_reference(arch, p, max_new) for p in prompts]
    eos = runs[0][rng.randrange(len(runs[0]))] if rng.random() < 0.5 else None
    expected = [r[:r.index(eos) + 1] if eos in r else r for r in runs]  # generate stops after the stop id
    options = dict(tree_budget=budget, draft_policy=policy, kv_page_size=8 if eos is not None else 64)
    plain = SpecEngine(_target(arch), _drafter(arch), **options)
    references = [p + _reference(arch, p, max_new + 4) for p in prompts]
    rigged = rig(SpecEngine(_target(arch), _drafter(arch), **options), references,
                 _random_ranks(seed=rng.randrange(100)))
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=() if eos is None else (eos,))
    for name, engine in (("dflash", plain), ("dflash-rigged", rigged)):
        results = engine.generate(prompts, params)
        for row, (res, exp) in enumerate(zip(results, expected)):
            assert res.token_ids == exp, f"{name} {arch} budget {budget} {policy} eos {eos} row {row}"
            assert res.finish_reason == ("stop" if eos in exp else "length")


def test_long_greedy_generation_with_many_tree_cycles():
    arch, max_new = "llama", 160
    prompts = [[3, 1, 4, 1, 5], list(range(20, 47))]
    references = [p + _reference(arch, p, max_new + 4) for p in prompts]
    engine = rig(SpecEngine(_target(arch), _drafter(arch), tree_budget=16, draft_policy="fixed"), references,
                 _random_ranks(seed=7))
    results = engine.generate(prompts, SamplingParams(max_new_tokens=max_new))
    for res, prompt in zip(results, prompts):
        assert res.token_ids == _reference(arch, prompt, max_new)
        assert res.stats.num_drafts >= 40 and max(res.stats.acceptance_lengths) >= 3


def assert_caches_hold_the_committed_tokens(engine, batch):
    """Every live row's target cache slots [0, n) and its drafter context (written, or pending in the row's
    `PendingContext`) equal what a fresh forward over its n committed tokens computes."""
    fast, drafter = engine.fast, getattr(engine.proposer, "drafter", None)
    for i, r in enumerate(batch.rows):
        committed = r.prompt + r.output[:-1]  # the last output token is the bonus, not in the cache yet
        n = r.n_cached
        assert n == len(committed)
        ids, positions = torch.tensor([committed]), torch.arange(n)[None]
        fresh = fast.new_cache(1, n)
        _, features = fast.forward(ids, positions, fresh, capture=True)
        for mine, theirs in zip(cache_row(batch.kv.kv, i, n), cache_row(fresh, 0, n)):
            assert_close(mine, theirs, msg=f"target cache, row {i}")
        if drafter is None:  # a drafting method without the target's features
            continue
        pending_values = torch.cat(r.pending.values) if r.pending.length else features[0, :0]
        written = r.pending.start if r.pending.length else n
        assert written + r.pending.length == n
        assert_close(pending_values, features[0, written:n], msg=f"pending drafter features, row {i}")
        context = drafter.new_cache(1, n)
        drafter.write_context(context, features, positions, torch.ones(1, n, dtype=torch.bool))
        for mine, theirs in zip(cache_row(batch.proposer_state.kv, i, written), cache_row(context, 0, written)):
            assert_close(mine, theirs, msg=f"drafter context, row {i}")



@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_caches_hold_the_accepted_path_with_rows_joining_and_leaving(policy):
    """Continuous batching (open_batch / add / step) with trees whose accepted paths run through later siblings:
    after every cycle the caches hold exactly the committed tokens, and every request's output is the target's."""
    arch = "qwen3"
    rng = random.Random(policy)
    arrivals = {0: _prompts(rng, 2), 3: _prompts(rng, 1), 5: _prompts(rng, 2)}  # cycle -> prompts joining
    lengths = iter([30, 12, 25, 20, 8])
    jobs = [(cycle, p, next(lengths)) for cycle, ps in arrivals.items() for p in ps]
    references = [p + _reference(arch, p, m + 4) for _, p, m in jobs]
    engine = rig(SpecEngine(_target(arch), _drafter(arch), tree_budget=12, draft_policy=policy), references,
                 _random_ranks((0.2, 0.5, 0.3, 0.0), seed=3))
    batch, outputs, accepted_deep = engine.open_batch(), {}, 0
    for cycle in range(200):
        for req, (at, prompt, max_new) in enumerate(jobs):
            if at == cycle:
                events = engine.add(batch, [prompt], SamplingParams(max_new_tokens=max_new), request_ids=[req])
                for e in events:
                    outputs.setdefault(e.index, []).extend(e.token_ids)
        if not batch.rows and cycle > max(arrivals):
            break
        for e in engine.step(batch):
            outputs.setdefault(e.index, []).extend(e.token_ids)
        accepted_deep += sum(len(r.stats.acceptance_lengths) and r.stats.acceptance_lengths[-1] >= 3
                             for r in batch.rows)
        assert_caches_hold_the_committed_tokens(engine, batch)
    assert not batch.rows
    for req, (_, prompt, max_new) in enumerate(jobs):
        assert outputs[req] == _reference(arch, prompt, max_new), f"request {req}"
    if policy == "fixed":
        assert accepted_deep >= 5


def flat_costs(engine):
    """Measured costs in which verifying more tokens takes no longer (a GPU's verify at small sizes), recorded
    often enough that this run's own timings (a loaded CPU's) do not outvote them for several cycles."""
    for _ in range(COST_WINDOW + 1):
        for tokens in (2 ** i for i in range(10)):
            engine.costs.record(CycleTiming(tokens, min(tokens, 4), 0.002, 0.012))


def _auto_budget_run(policy, costs=None):
    """Three rows whose oracle holds the truth as every position's second candidate (a full tree of 120 nodes
    accepts the whole block), block 5, tree_budget="auto", stepped one cycle at a time with the caches checked
    after each: the tree sizes the rows verified."""
    arch, max_new = "qwen3", 60
    prompts = _prompts(random.Random(policy), 3)
    references = [p + _reference(arch, p, max_new + 5) for p in prompts]
    engine = SpecEngine(_target(arch), block_size=5, proposer=TreeOracle(references, lambda req, n: [1] * 16),
                        tree_budget="auto", draft_policy=policy)
    assert engine.scratch_slots == 64
    if costs:
        costs(engine)
    batch, outputs, results = engine.open_batch(), {}, {}
    for e in engine.add(batch, prompts, SamplingParams(max_new_tokens=max_new)):
        outputs.setdefault(e.index, []).extend(e.token_ids)
    while batch.rows:
        for e in engine.step(batch):
            outputs.setdefault(e.index, []).extend(e.token_ids)
            if e.finished:
                results[e.index] = e.result
        assert_caches_hold_the_committed_tokens(engine, batch)
    for req, prompt in enumerate(prompts):
        assert outputs[req] == _reference(arch, prompt, max_new) == results[req].token_ids
    return {w for r in results.values() for w in r.stats.verify_widths}


def test_auto_budget_grows_trees_where_they_pay():
    """Where a wider verify costs no more and deeper trees are accepted, the auto budget verifies trees larger
    than the block (up to 64 nodes: the scratch slots past each row's context)."""
    sizes = _auto_budget_run("adaptive", flat_costs)
    assert max(sizes) > 5, sizes


def test_auto_budget_grows_trees_under_the_fixed_policy():
    """The fixed policy's cycles must feed the cost model too: its first measured size prices every larger one
    flat (an optimistic guess, `Curve`), so the auto budget tries a larger tree within a few cycles."""
    sizes = _auto_budget_run("fixed")
    assert max(sizes) > 5, sizes


def test_preempted_rows_with_trees_end_with_the_targets_output():
    """Rows taken out mid-generation and prefilled again (`preempt` / `resume`) with trees: greedy rows end with
    the target's output, a seeded sampled row with plain decoding's."""
    target = _target("qwen3")
    prompts = PREEMPTION_PROMPTS
    params = [SamplingParams(max_new_tokens=30)] * 3 + [_sampled(9, max_new=30)]
    plain = SpecEngine(target).generate([prompts[3]], [params[3]])[0].token_ids
    engine = rig(SpecEngine(target, _drafter("qwen3"), tree_budget=12, draft_policy="fixed"),
                 [p + _reference("qwen3", p, 34) for p in prompts[:3]] + [prompts[3] + plain],
                 _random_ranks(seed=11))
    outputs, preemptions = run_with_preemption(engine, prompts, params)
    assert [outputs[i] for i in range(3)] == [_reference("qwen3", p, 30) for p in prompts[:3]]
    assert outputs[3] == plain and preemptions >= 4


def test_trees_over_a_reduced_draft_vocabulary():
    """A drafter reading out over half the vocabulary: its candidates are mapped to target ids (greedy output is
    the target's, seeded sampled output plain decoding's)."""
    target = _target("qwen3")
    kept = select_draft_vocab(count_tokens([torch.tensor(_reference("qwen3", p, 24)) for p in GUMBEL_PROMPTS],
                                           VOCAB), VOCAB // 2)
    small = restrict_drafter(_drafter("qwen3"), target.get_output_embeddings().weight, kept)
    engine = SpecEngine(target, small, tree_budget=16, draft_policy="fixed")
    results = engine.generate(GUMBEL_PROMPTS, SamplingParams(max_new_tokens=24))
    assert [r.token_ids for r in results] == [_reference("qwen3", p, 24) for p in GUMBEL_PROMPTS]
    params = [_sampled(40 + i) for i in range(len(GUMBEL_PROMPTS))]
    plain = [SpecEngine(target).generate([p], [q])[0].token_ids for p, q in zip(GUMBEL_PROMPTS, params)]
    assert [r.token_ids for r in engine.generate(GUMBEL_PROMPTS, params)] == plain


# ---- sampling -------------------------------------------------------------------------------------------------

GUMBEL_PROMPTS = [[3, 4, 5, 6], [10, 11], [20, 21, 22, 23, 24, 25, 26], [40]]


def _sampled(seed, temperature=1.0, max_new=24, **kw):
    return SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=seed, **kw)


def test_seeded_output_with_trees_is_plain_decodings():
    target = _target("qwen3")
    params = [_sampled(100 + i, temperature=[1.0, 0.7, 1.3, 1.0][i], top_k=[0, 0, 20, 0][i],
                       top_p=[1.0, 0.9, 1.0, 1.0][i]) for i in range(len(GUMBEL_PROMPTS))]
    plain_engine = SpecEngine(target)
    plain = [plain_engine.generate([p], [q])[0].token_ids for p, q in zip(GUMBEL_PROMPTS, params)]
    extra_prompts, extra_params = [[7, 8, 9], [50, 51]], [SamplingParams(max_new_tokens=24), _sampled(None)]
    refs = [p + o for p, o in zip(GUMBEL_PROMPTS, plain)]
    engines = {
        "dflash-16": SpecEngine(target, _drafter("qwen3"), tree_budget=16),
        "dflash-auto-fixed": SpecEngine(target, _drafter("qwen3"), tree_budget="auto", draft_policy="fixed"),
        "oracle-24": SpecEngine(target, block_size=5, tree_budget=24, draft_policy="fixed",
                                proposer=TreeOracle(refs + [[]] * 2, _random_ranks(seed=5))),
        "oracle-auto": SpecEngine(target, block_size=5, tree_budget="auto",
                                  proposer=TreeOracle(refs + [[]] * 2, lambda req, n: [1] * 16)),
    }
    for name, engine in engines.items():
        alone = [engine.generate([p], [q])[0].token_ids for p, q in zip(GUMBEL_PROMPTS, params)]
        assert alone == plain, name
        batch = engine.generate(GUMBEL_PROMPTS + extra_prompts, params + extra_params)
        assert [r.token_ids for r in batch[:len(GUMBEL_PROMPTS)]] == plain, name
        assert batch[len(GUMBEL_PROMPTS)].token_ids == _reference("qwen3", extra_prompts[0], 24), name
    oracle = engines["oracle-24"].generate(GUMBEL_PROMPTS, params)
    assert sum(r.stats.num_accepted_tokens for r in oracle) > 40  # the oracle's paths really were accepted


@pytest.fixture(scope="module")
def small_target():
    """test_sampling's tiny-vocabulary target, whose joint distribution of a few tokens can be enumerated."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    model = Qwen3ForCausalLM(cfg).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def small_drafter(small_target):
    torch.manual_seed(5)
    config = make_draft_config(small_target.config, num_layers=1, block_size=4, mask_token_id=SMALL_MASK)
    return DFlashDraftModel(config).double().eval()


def transition_pvalues(model, params, samples):
    """Per position j >= 1: chi-square of the (token j - 1, token j) counts against, for each previous token, the
    sum of the target's exact distributions given the prefixes of the samples that had it (a group's total is
    given, so each group costs a degree of freedom; bins with expected count < 5 pooled within their group).
    Unlike a position's marginal, this sees a sampler that draws token j from the wrong context."""
    probs = conditional_probs(model, params, samples)
    tokens = torch.tensor(samples)
    pvalues = []
    for j in range(1, tokens.shape[1]):
        obs, exp, groups, impossible = [], [], 0, False
        for previous in range(SMALL_VOCAB):
            rows = tokens[:, j - 1] == previous
            observed = torch.bincount(tokens[rows, j], minlength=SMALL_VOCAB).double()
            expected = probs[rows, j].sum(0)
            big = expected >= 5
            group_obs, group_exp = observed[big].tolist(), expected[big].tolist()
            rest_obs, rest_exp = float(observed[~big].sum()), float(expected[~big].sum())
            if rest_exp > 0:
                group_obs.append(rest_obs)
                group_exp.append(rest_exp)
            impossible |= rest_exp == 0 and rest_obs > 0  # a token the target cannot sample there
            if len(group_obs) >= 2:
                obs += group_obs
                exp += group_exp
                groups += 1
        exp = [e * sum(obs) / sum(exp) for e in exp]  # equal up to rounding; scipy wants them equal to 1e-8
        pvalues.append(0.0 if impossible else float(chisquare(obs, exp, ddof=groups - 1).pvalue))
    return pvalues


def first_two_tokens(model, params):
    """The target's exact joint distribution of its first two sampled tokens."""
    pairs = list(itertools.product(range(SMALL_VOCAB), repeat=2))
    probs = conditional_probs(model, params, pairs)
    joint = probs.gather(-1, torch.tensor(pairs)[..., None])[..., 0].prod(-1)
    return dict(zip(pairs, joint.tolist()))


# one case of the counter-based sampler: its output is plain decoding's sample for sample (seeded: see
# test_seeded_output_with_trees_is_plain_decodings), whose distribution test_sampling checks
SAMPLING_CASES = {  # name: (sampler, tree budget, params, mixed widths, samples)
    "gumbel-topk-topp-mixed": ("gumbel", 9, SamplingParams(temperature=0.9, top_k=6, top_p=0.8), True, 500),
    "rejection-t1": ("rejection", 20, SamplingParams(temperature=1.0), False, 800),
    "rejection-topk-topp-mixed": ("rejection", 9, SamplingParams(temperature=0.9, top_k=6, top_p=0.8), True, 800),
}


def tree_samples(target, drafter, sampler, budget, params, mixed, monkeypatch, n):
    """n seeded generations of N_LONG tokens through an engine with trees (drafting every cycle; with `mixed`,
    rows of one batch at different widths every cycle: trees beside one-token steps in one forward)."""
    if mixed:
        monkeypatch.setattr(engine_module, "new_policy", lambda name, block_size, *a, **k: MixedWidths(block_size))
    engine = SpecEngine(target, drafter, tree_budget=budget, sampler=sampler, draft_policy="fixed")
    _, samples = empirical(engine, params, n=n, batch=n, n_long=n)
    return samples


def distribution_failures(target, params, samples):
    """What the checks find wrong with the samples: the first two tokens' joint distribution, each position's
    marginal, each position's transitions (empty: none)."""
    counts = {}
    for s in samples:
        counts[tuple(s[:2])] = counts.get(tuple(s[:2]), 0) + 1
    exact = first_two_tokens(target, params)
    p_value, tv = fit(exact, counts)
    failures = []
    if not (p_value > P_MIN and tv < 1.5 * null_total_variation(exact, len(samples)) + 0.01):
        failures.append(f"first two tokens: chi-square p={p_value:.2e}, TV={tv:.4f}")
    for name, pvalues in (("marginal", per_position_pvalues(target, params, samples)),
                          ("transition", transition_pvalues(target, params, samples))):
        if min(pvalues) <= P_MIN / N_LONG:
            failures.append(f"{name} p-values per position {[f'{p:.1e}' for p in pvalues]}")
    return failures


@pytest.mark.parametrize("name", SAMPLING_CASES)
def test_tree_sampling_matches_target_distribution(small_target, small_drafter, name, monkeypatch):
    sampler, budget, params, mixed, n = SAMPLING_CASES[name]
    verdicts = []

    def recorded(*args, **kwargs):
        verdicts.append(verify_tree(*args, **kwargs))
        return verdicts[-1]

    monkeypatch.setattr(engine_module, "verify_tree", recorded)
    samples = tree_samples(small_target, small_drafter, sampler, budget, params, mixed, monkeypatch, n)
    assert sum(int(v.num_accepted.sum()) for v in verdicts) > n  # trees did commit tokens
    assert distribution_failures(small_target, params, samples) == [], name


def test_tree_sampling_checks_detect_a_walk_off_by_one_node(small_target, small_drafter, monkeypatch):
    """A walk that judges each node by its parent's logits (the root by its own) samples every token after the
    first from one context too early: the checks must fail (each position's marginal alone would not notice)."""

    def parents_logits(target_logits, tree, params, generators=None, noise=None):
        parent = tree.parents.clamp_min(0)
        shifted = target_logits.gather(1, parent[..., None].expand(-1, -1, target_logits.shape[-1]))
        return verify_tree(shifted, tree, params, generators, noise)

    monkeypatch.setattr(engine_module, "verify_tree", parents_logits)
    params = SamplingParams(temperature=1.0)
    samples = tree_samples(small_target, small_drafter, "rejection", 20, params, False, monkeypatch, n=600)
    assert any(f.startswith("transition") for f in distribution_failures(small_target, params, samples))


# ---- configuration ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 513, "wide", 2.5, None, "16", True])
def test_bad_tree_budgets_raise_with_the_options_name(bad):
    with pytest.raises(ValueError, match="tree_budget"):
        EngineConfig(tree_budget=bad)
    with pytest.raises(ValueError, match="tree_budget"):
        SpecEngine(_target("qwen3"), _drafter("qwen3"), tree_budget=bad)
    for good in (0, 1, 512, "auto"):
        assert EngineConfig(tree_budget=good).tree_budget == good


@pytest.mark.parametrize("arch,options", [("olmo2", {}), ("qwen3", {"fast_path": False}),
                                          ("qwen3", {"exact": True})])
def test_trees_fall_back_to_the_chain_losslessly(arch, options):
    target = _target(arch)
    drafter = make_drafter(target, block_size=4)
    with pytest.warns(UserWarning, match="tree_budget=16 ignored"):
        engine = SpecEngine(target, drafter, tree_budget=16, **options)
    assert engine.tree_budget == 0 and engine.scratch_slots == 4
    prompts = [[1, 2, 3], list(range(30, 47))]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=20))
    assert [r.token_ids for r in results] == [_reference(arch, p, 20) for p in prompts]


def test_proposer_without_candidates_verifies_the_chain():
    target = _target("qwen3")
    prompts = [[5, 6, 7]]
    expected = _reference("qwen3", prompts[0], 20)
    with pytest.warns(UserWarning, match="OracleProposer proposes no candidates"):
        engine = SpecEngine(target, block_size=4, tree_budget="auto",
                            proposer=OracleProposer([prompts[0] + expected], seed=1))
    assert engine.tree_budget == 0
    assert engine.generate(prompts, SamplingParams(max_new_tokens=20))[0].token_ids == expected


@pytest.mark.skipif(compile_unavailable(torch.device("cpu")) is not None, reason="no C++ compiler for torch.compile")
def test_compiled_engine_warns_and_keeps_the_chain():
    target = make_target("qwen3", dtype=torch.float32)
    with pytest.warns(UserWarning, match="compiled steps verify one width"):
        engine = SpecEngine(target, make_drafter(target, block_size=4, dtype=torch.float32), compile=True,
                            tree_budget=8)
    assert engine.tree_budget == 0 and engine.block_step is not None


def test_calibration_counts_what_each_prefix_of_a_tree_would_have_accepted():
    """A verified tree calibrates every smaller size: its prefix of s nodes accepts the path up to the first node
    numbered s or more; sizes above the tree's own are left alone, and an unmeasured size takes the largest
    measured one's ratio."""
    from flashdraft.engine.tree import TreeCalibration

    tree = RowTree(list(range(12)), [-1, 0, 1, 0, 2, 1, 3, 4, 5, 8, 6, 9], [0, 1, 2, 1, 3, 2, 2, 4, 3, 4, 3, 5],
                   [0.0] + [-0.1 * j for j in range(1, 12)])
    calibration = TreeCalibration((4, 8, 12, 16))
    calibration.observe(tree, [0, 1, 5, 8, 9])
    assert calibration.accepted == {4: 1.0, 8: 2.0, 12: 4.0}
    expected = tree.expected_accepted()
    assert calibration.expected[8] == pytest.approx(expected[7])
    assert calibration.scale(8) == pytest.approx(2.0 / expected[7])
    assert calibration.scale(16) == calibration.scale(12)
    assert TreeCalibration().scale(16) == 1.0


def test_auto_shape_tries_both_then_runs_the_faster_and_explores_the_other():
    """`tree_budget="auto"` chooses trees or the chain by measured committed tokens per second per row bucket: both
    are tried first, then the faster runs, the other every SHAPE_EXPLORE-th cycle; a bucket learns apart."""
    from flashdraft.engine.tree import SHAPE_EXPLORE, SHAPE_TRIES, ShapeChoice

    choice = ShapeChoice()
    speed = {True: 3.0, False: 4.0}  # tokens per second: the chain is faster here
    picks = []
    for _ in range(2 * SHAPE_TRIES + 4 * SHAPE_EXPLORE):
        trees = choice.use_trees(1)
        picks.append(trees)
        choice.observe(1, trees, 10, 10 / speed[trees])
    assert picks[:2 * SHAPE_TRIES].count(True) == SHAPE_TRIES  # each kind tried
    settled = picks[2 * SHAPE_TRIES:]
    assert settled.count(True) == len(settled) // SHAPE_EXPLORE  # the slower kind only when exploring
    assert choice.rate(1, False) == pytest.approx(4.0) and choice.rate(1, True) == pytest.approx(3.0)
    assert choice.rate(16, True) is None and choice.use_trees(16)  # another row bucket starts over
    speed = {True: 5.0, False: 4.0}  # load changed: trees pay now; explorations refill their window
    for _ in range(8 * SHAPE_EXPLORE * 8):
        trees = choice.use_trees(1)
        choice.observe(1, trees, 10, 10 / speed[trees])
    assert choice.rate(1, True) > choice.rate(1, False)
    assert sum(choice.use_trees(1) for _ in range(SHAPE_EXPLORE)) == SHAPE_EXPLORE - 1


def test_auto_prices_tree_cycles_apart_from_the_policy():
    """With "auto", tree cycles feed `tree_costs` (which sizes trees) and chain cycles the policy's cost model; the
    output stays the target's either way."""
    rng = random.Random(7)
    prompts = _prompts(rng, 2)
    references = [p + _reference("qwen3", p, 40) for p in prompts]
    oracle = TreeOracle(references, _random_ranks(seed=3))
    engine = SpecEngine(_target("qwen3"), block_size=8, proposer=oracle, tree_budget="auto", draft_policy="fixed")
    kinds = []
    choose = engine.tree_shape.use_trees
    engine.tree_shape.use_trees = lambda rows: kinds.append(choose(rows)) or kinds[-1]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=32))
    assert [r.token_ids for r in results] == [_reference("qwen3", p, 32) for p in prompts]
    assert True in kinds and False in kinds  # both tried
    assert engine.tree_costs.body.timings == kinds.count(True)
    assert engine.costs.body.timings == kinds.count(False)  # the fixed policy: every cycle drafts


@pytest.mark.parametrize("field", ["block_size", "kv_page_size", "lookup_ngram"])
def test_a_bool_is_not_a_size(field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: True})
