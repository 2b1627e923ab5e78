"""Token trees: verify more than the argmax chain from one draft.

A DFlash draft is one forward that yields a distribution at each of the k block positions; the chain verifies the
argmax of each. A tree verifies several candidates per position, chosen best-first by the product of the draft
probabilities along their path (the drafter's own estimate that the target accepts the whole path) under a node
budget: each node added is the most likely one left, and any prefix of that order is a tree (a node's parent is
always more likely than the node). The drafter's positions come out of one parallel forward, so every node at
depth d takes its children from the same top candidates of position d + 1.

Layout of one row's tree: node 0 is the root, the bonus token at the row's next position n; nodes are in
topological order (a parent before its children); node j holds a candidate for position n + depths[j]. The target
reads every node in one forward (`FastTarget.forward_ragged` with a `TreeShape`): node j's K/V go to scratch slot
n + j, its rotary position is n + depths[j], and it attends to the row's context (slots < n) and to its own
ancestors. The shared verifier walks the tree (`verify.verify_tree`); the accepted path's K/V then move to slots
n .. n + a and its features become the drafter's next context, so from there on the row is a chain again.

`expected_accepted` is what the draft policy weighs against the cost of verifying more tokens (`tree_sizes`):
the sum of the path probabilities of a tree's nodes is its expected accepted length, were the drafter calibrated;
the engine scales it by how the row's trees actually did.

What this module does not know about: models, caches, sampling (it takes candidate scores and returns shapes).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from flashdraft.engine.batch import next_power_of_two

TREE_CANDIDATES = 8  # candidates per block position a tree may branch into (the top of the drafter's marginal)
AUTO_TREE_SIZES = (16, 24, 32, 48, 64)  # nodes per tree (root included) that `tree_budget="auto"` chooses among
CALIBRATION_SMOOTHING = 0.05
SHAPE_WINDOW, SHAPE_TRIES, SHAPE_EXPLORE = 64, 4, 16  # `ShapeChoice`: cycles kept, tried, between explorations


@dataclass
class TokenTree:
    """Trees of the same node count for g rows: tokens, parents (root: -1) and depths, each [g, nodes]."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def ancestors(self) -> torch.Tensor:
        """[g, nodes, nodes] bool: entry (j, i) is True iff node i is node j or one of its ancestors."""
        g, w = self.tokens.shape
        eye = torch.eye(w, dtype=torch.bool, device=self.tokens.device)
        anc = eye[None].repeat(g, 1, 1)
        rows = torch.arange(g, device=self.tokens.device)
        for j in range(1, w):  # topological order: a parent's row is complete before its children's
            anc[:, j] |= anc[rows, self.parents[:, j]]
        return anc

    def children(self) -> list[dict[tuple[int, int], int]]:
        """Per row: (parent node, token) -> child node."""
        return [{(p, t): j for j, (p, t) in enumerate(zip(ps, ts)) if j}
                for ps, ts in zip(self.parents.tolist(), self.tokens.tolist())]

    def path_depth(self) -> int:
        return int(self.depths.max()) if self.depths.numel() else 0


@dataclass
class RowTree:
    """One row's tree in best-first order (node 0 the root): tokens, parents, depths, and the path log-probability
    of each node (root: 0), non-increasing after the root."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    path_logp: list[float]

    def prefix(self, nodes: int) -> "RowTree":
        return RowTree(self.tokens[:nodes], self.parents[:nodes], self.depths[:nodes], self.path_logp[:nodes])

    def expected_accepted(self) -> np.ndarray:
        """[nodes]: the expected accepted length of the tree cut to its first i + 1 nodes, under the draft
        probabilities (a node is accepted iff its whole path is)."""
        return np.cumsum(np.exp(self.path_logp)) - 1.0


class TreeCalibration:
    """How far trees of each candidate size get against what the draft probabilities promise: per size, moving
    averages of accepted and expected accepted length. A verified tree also tells what every smaller tree would
    have accepted: its best-first prefix of s nodes holds the accepted path up to the first node numbered s or
    more (the target's choices along the path do not depend on the nodes off it), so trees of the size in use
    calibrate all sizes below it. A size never reached takes the ratio of the largest one measured. Drafters are
    rarely calibrated, and least on the deep, unlikely nodes that only large trees hold."""

    def __init__(self, sizes: tuple[int, ...] = AUTO_TREE_SIZES):  # ascending
        self.sizes = sizes
        self.expected: dict[int, float] = {}
        self.accepted: dict[int, float] = {}

    def observe(self, tree: "RowTree", path: list[int]) -> None:
        """One verified tree and its accepted path (node indices from the root)."""
        expected = tree.expected_accepted()
        for size in self.sizes:
            if size > len(tree.tokens):
                break
            depth = next((d for d, node in enumerate(path) if node >= size), len(path)) - 1
            e, a = float(expected[size - 1]), float(depth)
            if size not in self.expected:
                self.expected[size], self.accepted[size] = e, a
                continue
            self.expected[size] += CALIBRATION_SMOOTHING * (e - self.expected[size])
            self.accepted[size] += CALIBRATION_SMOOTHING * (a - self.accepted[size])

    def scale(self, size: int) -> float:
        """accepted / expected for trees of `size` nodes (1.0 before any tree was verified)."""
        measured = [s for s in self.expected if s <= size]
        if not measured:
            return 1.0
        key = size if size in self.expected else max(measured)
        return self.accepted[key] / self.expected[key] if self.expected[key] > 0 else 1.0


class ShapeChoice:
    """`tree_budget="auto"`: whether a drafting cycle verifies token trees or the chain, from the committed tokens
    per second each has measured at the batch's row count (power-of-two buckets, the last `SHAPE_WINDOW` cycles of
    each). The tree sizes' cost model prices tokens verified; what trees cost beyond that (the candidates, the
    best-first heap, the mask, the walk) and how far their calibration errs are only seen in the cycle's own
    time, so the choice is made on that. Each kind is tried `SHAPE_TRIES` times per bucket; then the faster one
    runs and the other every `SHAPE_EXPLORE`-th drafting cycle, so a change of load or of prompts is noticed."""

    def __init__(self):
        self.cycles: dict[tuple[int, bool], deque] = {}  # (row bucket, trees) -> (committed tokens, seconds)
        self.drafting_cycles: dict[int, int] = {}

    def rate(self, rows: int, trees: bool) -> float | None:
        window = self.cycles.get((next_power_of_two(rows), trees))
        if not window or len(window) < SHAPE_TRIES:
            return None
        return sum(t for t, _ in window) / max(sum(s for _, s in window), 1e-9)

    def use_trees(self, rows: int) -> bool:
        key = next_power_of_two(rows)
        n = self.drafting_cycles[key] = self.drafting_cycles.get(key, 0) + 1
        trees, chain = self.rate(rows, True), self.rate(rows, False)
        if trees is None or chain is None:  # try both: trees first, then alternate until each has its tries
            return trees is None and (chain is not None or n % 2 == 1)
        faster = trees >= chain
        return faster != (n % SHAPE_EXPLORE == 0)

    def observe(self, rows: int, trees: bool, committed: int, seconds: float) -> None:
        window = self.cycles.setdefault((next_power_of_two(rows), trees), deque(maxlen=SHAPE_WINDOW))
        window.append((committed, seconds))


def best_first(root: int, candidates: list[list[int]], logp: list[list[float]], budget: int) -> RowTree:
    """The `budget` most likely nodes under the product of per-position candidate probabilities, plus the root.

    candidates[d] / logp[d]: position d + 1's candidate tokens and their log-probabilities, most likely first.
    Each popped node pushes its first child and its next sibling, both no more likely than itself, so nodes come
    out in order of their path probability and every parent before its children."""
    tree = RowTree([root], [-1], [0], [0.0])
    depth_max = len(candidates)
    if depth_max == 0:
        return tree
    heap = [(-logp[0][0], 1, 0, 0)]  # (-path logp, depth, candidate rank, parent node)
    while heap and len(tree.tokens) <= budget:
        neg, depth, rank, parent = heapq.heappop(heap)
        node = len(tree.tokens)
        tree.tokens.append(candidates[depth - 1][rank])
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.path_logp.append(-neg)
        if depth < depth_max:
            heapq.heappush(heap, (neg - logp[depth][0], depth + 1, 0, node))
        if rank + 1 < len(candidates[depth - 1]):
            sibling = neg + logp[depth - 1][rank] - logp[depth - 1][rank + 1]
            heapq.heappush(heap, (sibling, depth, rank + 1, parent))
    return tree


def chain(root: int, drafts: list[int]) -> RowTree:
    """The chain as a tree: node d is draft d, child of node d - 1."""
    n = len(drafts)
    return RowTree([root] + list(drafts), list(range(-1, n)), list(range(n + 1)), [0.0] * (n + 1))


def lookup_continuation(history: list[int], max_ngram: int, length: int) -> list[int]:
    """Prompt lookup: the `length` tokens that followed the latest earlier occurrence of the history's last n
    tokens (the longest n <= max_ngram that occurs), or [] if none does. The target often repeats its context
    (code, lists, quotes); this continuation costs no model call."""
    h = np.asarray(history)
    for n in range(min(max_ngram, len(h) - 1), 0, -1):
        suffix = h[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)  # starts 0 .. len - n - 1: not the suffix
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return h[start:start + length].tolist()
    return []


def add_branch(tree: RowTree, tokens: list[int]) -> RowTree:
    """The tree with a path of `tokens` under the root: shared where the tree already holds those tokens, new nodes
    appended (path probability 0: the drafter does not vouch for them) where it does not."""
    children = {(p, t): j for j, (p, t) in enumerate(zip(tree.parents, tree.tokens)) if j}
    out = RowTree(list(tree.tokens), list(tree.parents), list(tree.depths), list(tree.path_logp))
    node = 0
    for token in tokens:
        if (node, token) not in children:
            children[(node, token)] = len(out.tokens)
            out.tokens.append(token)
            out.parents.append(node)
            out.depths.append(out.depths[node] + 1)
            out.path_logp.append(float("-inf"))
        node = children[(node, token)]
    return out


def stack(trees: list[RowTree], device) -> TokenTree:
    """Row trees of one node count as one `TokenTree`."""
    def as_tensor(name):
        return torch.tensor([getattr(t, name) for t in trees], dtype=torch.long, device=device)

    return TokenTree(as_tensor("tokens"), as_tensor("parents"), as_tensor("depths"))


def candidate_lists(scores: torch.Tensor, top: int = TREE_CANDIDATES) -> tuple[list, list]:
    """From draft scores [b, k, V] (log-probabilities, or logits: normalised here) the top candidates of every
    position: (tokens [b][k][top], log-probabilities [b][k][top]) as lists, most likely first."""
    scores = scores.float()
    values, ids = scores.topk(min(top, scores.shape[-1]), dim=-1)
    return ids.tolist(), (values - torch.logsumexp(scores, dim=-1, keepdim=True)).tolist()


def tree_attention_mask(ancestors: torch.Tensor, context: torch.Tensor, key_len: int) -> torch.Tensor:
    """The mask [g, 1, nodes, key_len] of a tree forward: node j sees the row's context slots [0, context) and the
    scratch slots context + i of its ancestors i (itself included). context [g]: each row's committed length."""
    g, w, _ = ancestors.shape
    slots = torch.arange(key_len, device=ancestors.device)[None]  # [1, key_len]
    offset = slots - context[:, None]  # [g, key_len]: the node a scratch slot holds
    in_tree = (offset >= 0) & (offset < w)
    node = offset.clamp(0, w - 1)[:, None, :].expand(g, w, key_len)
    visible = ancestors.gather(2, node) & in_tree[:, None, :]
    return (visible | (offset < 0)[:, None, :])[:, None]
