"""Draft policies: how many tokens each row of a batch verifies in its next cycle.

Before a cycle the engine asks `widths(rows)` for one verify width per row: w tokens = the bonus + w - 1 drafts,
or w = 1, a one-token step without a draft (the same verifier; the target's features still reach the drafter).
After the draft it may ask `trim(rows, widths, confidence, drafted_tokens)` for narrower widths, by the drafter's
confidence in each draft (the confidence trim, below). After the cycle it reports
`observe(rows, widths, accepted, timing)` with the planned widths. A row's policy state (`RowAcceptance`) is
created by `new_row()` and travels with the row.

- `FixedWidth`: every row verifies the full block every cycle (`draft_policy="fixed"`).
- `AdaptiveWidth` (the default): every cycle chooses the widths that maximise the batch's expected committed tokens
  per second, from two models kept current while running, and checks the plans against what they gave:
  - acceptance, per row: `RowAcceptance.acceptance[i]` estimates P(draft position i+1 is accepted | positions
    1 .. i were), an exponential moving average over the row's drafts that reached the position (verified, every
    draft before it accepted); positions a draft did not reach keep their estimate. A position's survival, which
    a width's expected gain sums, is the product of the acceptances up to it. (Survival estimated per position
    and censored at the width verified kept, past a narrow width, what an early bad stretch had left: a row
    accepting all 7 drafts of width 8 cycle after cycle was never offered the block again, and the demo at batch
    1 ran 1.9-2.1x plain decoding against 2.5x for the fixed block.) A new row starts from the engine's prior:
    the same averages over every row's drafts, kept apart for greedy and sampled rows (acceptance at temperature
    1 says little about greedy rows; the sampled rows' prior is a plain mean over its first drafts, so it leaves
    the optimistic start at once), its first draft priced by the lower of that and the prior of rows' first drafts
    (an answer's first block accepts least: `AcceptancePriors`), as that prior is at each plan until the row has
    drafted; a plan drafts only a few rows on the first-draft prior per first draft it has seen
    (`UNTESTED_PER_FIRST_DRAFT`), so a first wave tests the optimistic start on a row or two before the batch bets
    on it. A row left at one-token steps is probed after a
    while (4 steps, doubling up to 128 while probes keep losing; a new sampled row starts from the wait the last
    sampled row reached by drafting, so at temperature 1 with a weak drafter a new request does not lose its first
    probes again, a new greedy row from 4: greedy acceptance is the prompt's): judged by the optimistic starting
    prior once,
    one row per cycle (rows that joined together come due together; a probe of all of them at once drafted the
    whole batch on optimistic estimates), so it drafts again where drafting could pay; what its drafts
    show then updates the row's own estimates, and the wait keeps doubling until the row drafts on those again
    (a probe the plan declines counts as lost), so good drafts at a load where drafting does not pay neither
    probe every few steps nor pile up into one cycle where every row drafts on the optimistic prior. A request
    whose drafts recover is drafting again within a few probes. A probe the cost model declines on a cycle size
    timed fewer than SETTLED times drafts anyway (and times it), so one cold timing does not keep rows from drafting.
  - cost (`CostModel`, shared by an engine's batches): seconds of the cycle without its draft (target forward,
    verification, commit: all grow with the tokens verified) by the number of tokens verified, of the draft by
    the number of positions drafted (rows x block drafted) and of writing a draft's pending context first by the
    positions written, each the median of the last timings per power-of-two bucket (one preempted cycle on a busy
    machine does not move it), interpolated between buckets, flat beyond the largest size timed (the plan tries a
    larger one and so measures it), and never decreasing with size (a size timed slow
    once and avoided since is capped by the larger sizes timed after it). A bucket not measured for a
    while is forgotten (the plan then tries it again). Nothing is hard-coded: a busy machine or a GPU gets its own
    curves within a few cycles.
  - goodput (`Goodput`), from two rows up: what drafting cycles and one-token steps actually committed per second
    at the batch's load; where drafting gave less, the plan is not asked and every row steps, for a hold that
    doubles while drafting keeps losing (and from the second loss in a row lasts long enough that judging costs
    at most 2 % of the time). It catches what the two models get wrong together (chosen rows accept
    less than the estimates that chose them; costs the curves do not see), which left the plan drafting at loads
    where drafting lost.
  A plan of one-token steps only is kept for `REPLAN_PLAIN_EVERY` cycles while the batch stays in its row
  bucket: a row that joins meanwhile is judged alone on its prior estimates, as a probe is (the batch is planned
  afresh only if drafting that row alone would pay), and a row that leaves changes nothing, so a server's churn
  (at 16 rows of 64-token requests a row joins every ~2 cycles) does not re-run the full plan every other cycle.
  `SpecEngine.warmup` (run by `flashdraft serve`) times one-token steps and block cycles at every row bucket, and
  pending-context writes of 16-256 positions per row, so a server plans its first requests from measured costs.
  With ragged verification (the fast target path, eager) each row gets its own width: the plan starts from the
  best batch-wide width and then lets every row take the width that pays at the batch's throughput (one
  Dinkelbach step on the linearised cost). Where one forward pads every row to the widest one (compiled steps,
  the generic transformers path) all rows share one width, chosen the same way. The widths come from `choices`
  (`width_choices`: 1, the powers of two below the block, the block; an engine whose drafts are always whole
  blocks offers 1 and the block). The draft is priced by the positions drafted: the widest drafting row's width
  where the drafter stops there (`drafts_to_width`), else the block.
  - lookup steps (`lookup_widths`, `observe_lookups`): a row the plan leaves at a one-token step may verify
    a prompt-lookup continuation the engine found instead; it verifies the tokens whose expected acceptance
    (`RowAcceptance.lookup`, moving averages like the drafter's, from an engine-wide prior per kind of row) beats
    their share of the longer forward at the rate of one-token steps. Such a step is a one-token step for
    everything else here. From GOODPUT_ROWS rows what cycles with copies commit per second is checked against
    bare one-token steps at the same load (`LookupGoodput`), and a load where copies gave less searches none for
    a hold.

  - the confidence trim (`trim`): after the draft, each drafting row verifies the width up to its planned one
    whose expected accepted drafts best pay for their verification at the cycle's expected rate; a draft
    survives with the product of the calibrated confidences up to it (`ConfidenceCalibration`: the drafter's
    confidence -> P(accepted | the drafts before it were), per kind of row, learnt from verified drafts). Drafts a
    trim left unverified after an accepted prefix move the acceptance estimates by their calibrated confidence, not
    as rejections; every CALIBRATE_EVERY-th drafting row and cycles that time a size are not trimmed; plans price a
    drafting row by the share of drafts the trim has been verifying at its width (`verified_share`).

Decisions depend on timing, so they depend on the machine's load; the output does not: greedy rows commit the
target's argmax and sampled rows under the default counter-based noise commit plain decoding's tokens whatever is
drafted (`verify.py`). Under rejection sampling the distribution stays exact, but a seed no longer pins the text.

What this module does not know about: drafters, caches, tokens; time only as the seconds the engine reports.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass

import numpy as np

SMOOTHING = 0.3  # weight of the newest observation in a row's acceptance estimates
COST_WINDOW = 9  # a cost bucket is the median of its last timings: a cycle the OS preempted does not move it
# a probe the cost model declines on a cycle size timed fewer than SETTLED times (after its untimed first) drafts
# anyway, so one cold timing cannot keep a row from drafting: priced by one slow timing (200 ms against ~1 ms), a
# block cycle looked 200 one-token steps dear, every probe was declined and the size was never timed again (the
# shipped pair at batch 1: 0 drafting cycles in 1,016 tokens after it). On an H100 the shipped pair in bf16 never
# drafted in 1,016 tokens at batch 1 (0.39x plain decoding); a cold timing (the first launch of a CUDA kernel loads
# it) is the lead. From SETTLED timings a bucket is their median, which one outlier does not move
SETTLED = 3
# the engine-wide prior moves slowly: it summarises many rows. The sampled rows' prior is the mean of the drafts
# it has seen at a position (the optimistic start counting as one) until it has seen 1 / PRIOR_SMOOTHING of them:
# moving slowly from the start, a weak drafter's first rows at temperature 1 drafted on a prior still near 0.9,
# lost and reset the wait new rows inherit (32 requests at batch 1: 17 such cycles accepting 6 drafts in all, beside
# 27 probes; 0.93x plain decoding, 1.00x with the mean). The greedy rows' prior stays slow: with the mean, a few
# early short acceptances left greedy rows stepping one token at a time (the same 32 prompts: 1.40x -> 1.00x)
PRIOR_SMOOTHING = 0.05
MIN_PLAIN_RUN, MAX_PLAIN_RUN = 4, 128  # one-token steps before a row is probed again, doubling while probes lose
OPTIMISTIC_ACCEPTANCE = 0.9  # per position, the prior before any draft was seen and a probe's: draft, then judge
# a cost bucket not measured in this many timings of its curve is forgotten; the plan then tries that size again
# (an unmeasured size is priced optimistically), which at 256 cost a 16-row batch of plain steps ~7 % of its
# throughput every ~1 s on CPU; at 2048 a bad timing still cannot keep a width out for more than seconds
STALE_AFTER = 2048
# a row drafting at a narrower width than the block, which would gain from the block, verifies the block once
# when the price of that wider cycle was last timed this many timings ago: a price set in a bad moment (a served
# engine's warm-up timed while two other servers warmed up beside it, 3x the block's later price) otherwise kept
# every row at width 8 until it went stale, STALE_AFTER timings: a whole served benchmark at batch 1, where a
# block cycle then cost what a width-8 one did
REFRESH_AFTER = 128
# cycles an all-one-token-step plan is kept while the batch stays in its row bucket (costs drift slowly; a probe and
# a row that joins are judged alone against it, each as if drafting beside one-token steps). 16 rather than 4: at batch 1 a plan costs ~5 % of a one-token step on CPU, and fewer replans on noisy
# timings drafted less where it lost (policy_sim.py at 1 row: mixed 1.09x -> 1.18x, bursty 1.73x -> 1.78x)
REPLAN_PLAIN_EVERY = 16
# the goodput check (`Goodput`), for batches of GOODPUT_ROWS rows or more: a row bucket's last DRAFTING_WINDOW
# drafting cycles against its last PLAIN_WINDOW cycles of one-token steps, judged every max(2, JUDGED_ROWS / rows)
# drafting cycles: 8 at 4 rows, 2 from 16 rows, where one cycle sums many rows' acceptance and lasts ~10 one-token
# steps. A bucket where drafting gave fewer tokens per second (HOLD_BELOW x theirs) takes only one-token steps for
# MIN_HOLD cycles, doubling up to MAX_HOLD while drafting keeps losing; a bucket never judged starts held when the
# nearest smaller one's last judgement was a loss. The windows are long because acceptance per row is geometric:
# windows of 8 cycles held winning buckets by chance (policy_sim.py); a 5 % margin left drafting that lost 3-6 %
GOODPUT_ROWS, JUDGED_ROWS, DRAFTING_WINDOW, PLAIN_WINDOW, HOLD_BELOW = 2, 32, 32, 32, 1.0
# 128 rather than 32, and a 2 % share rather than 5 %: where drafting never pays (16 rows on a CPU: the full block
# at 0.53-0.60x) every judgement costs two losing cycles, and the engine at 4 and 16 rows gained 3 % on average
# (two runs of `engine_concurrency.py --variant longhold:MIN_HOLD=128,JUDGEMENT_SHARE=0.02`, 7 of 8 cells level or
# better). The price: where the first plans (on the optimistic prior) draft failing rows beside good ones and lose,
# the good rows draft alone only after the first hold, 128 cycles (0.5-1 s at 4-16 rows on CPU)
MIN_HOLD, MAX_HOLD = 128, 1024
# from a load's second lost judgement in a row, a hold also lasts long enough that the judgement which started it
# (the time its drafting cycles took beyond what one-token steps needed for the same tokens) is at most this share
# of the hold: at 16 rows on CPU two judged cycles lost ~75 ms, and 32- and 64-cycle holds then gave a third of a
# short burst's time back to judging
JUDGEMENT_SHARE = 0.02
PLAIN_REFERENCE = 4  # one-token-step cycles measured before they, not the cost curve, are what drafting must beat
# cycles with lookup copies between two judgements of them (`LookupGoodput`; at least JUDGED_ROWS / rows): a copy
# commits a token or two, so one cycle says less than a drafting cycle does
LOOKUP_JUDGED = 8
# a kind of row (greedy, sampled) is searched for lookup copies while a search gives more tokens than its own time
# buys at one-token steps (both measured); else every SEARCH_PROBE_EVERY-th row the gate turns away is searched
# anyway, to keep measuring. At temperature 1 the shipped pair's 16 rows searched 1,000-1,900 times per 2,048 tokens
# for 0-8 accepted tokens (~2 % of their time); greedy, a search gave ~0.55 tokens. SEARCH_MEMORY: the searches the
# yield averages over (a mean until then)
SEARCH_PROBE_EVERY, SEARCH_MEMORY = 16, 512

# rows a plan may draft on the first-draft prior alone in one cycle, per first draft that prior has seen (two before
# any): the optimistic start is tested on a few rows before a whole first wave bets on it (`_cap_untested`). One
# per draft seen ramped 16 rows whose drafts pay up so slowly (1, 2, 4, 8 rows drafting) that the goodput check
# judged the ramp with the first exploring cycle and held the load; two ramp in three cycles
UNTESTED_PER_FIRST_DRAFT = 2

NUMBER = (int, float, np.integer, np.floating)


# the confidence trim (`AdaptiveWidth.trim`): the drafter's confidence in a draft is calibrated into P(accepted |
# the drafts before it were) in CONFIDENCE_BINS equal bins per kind of row (`ConfidenceCalibration`); every
# CALIBRATE_EVERY-th drafting row is left untrimmed, so the bins a trim cuts at still see drafts verified
CONFIDENCE_BINS, CALIBRATE_EVERY = 20, 16


def width_choices(block_size: int) -> tuple[int, ...]:
    """Verify widths a row may get: 1, powers of two below the block, the block (a handful of shapes)."""
    widths, w = [1], 2
    while w < block_size:
        widths.append(w)
        w *= 2
    return tuple(widths + [block_size]) if block_size > 1 else (1,)


def initial_prior(block_size: int) -> np.ndarray:
    """Acceptance per draft position before any draft was seen: optimistic, so rows draft first and are then
    judged."""
    return np.full(block_size - 1, OPTIMISTIC_ACCEPTANCE)


def bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def median(values: list[float]) -> float:
    """statistics.median's value, without its checks (a cost bucket takes two per cycle)."""
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


@dataclass
class CycleTiming:
    """What one cycle did and how long its parts took (seconds)."""

    verified_tokens: int  # tokens through the target forward (padding included where rows are padded)
    drafted_tokens: int  # positions through the drafter: drafting rows x the block it drafted (0: no draft)
    draft_s: float  # the plan and the draft, without writing context
    total_s: float
    context_tokens: int = 0  # pending context written into the drafter apart from the draft: rows x longest
    context_s: float = 0.0
    lookup_tokens: int = 0  # tokens of prompt-lookup copies verified at one-token steps (`lookup_widths`)


class Curve:
    """Seconds as a function of a size: (mean size, mean seconds) per power-of-two bucket, interpolated."""

    def __init__(self):
        self.points: dict[int, tuple[float, float]] = {}
        self.window: dict[int, deque] = {}
        self.seen: set[int] = set()
        self.measured_at: dict[int, int] = {}  # bucket -> the timing count when it was last measured
        self.timings = 0
        self._lists: tuple[list[float], list[float]] | None = None  # the curve's points, made non-decreasing
        self._xy: tuple[np.ndarray, np.ndarray] | None = None  # the same as arrays, built when an array call needs them

    def record(self, size: int, seconds: float) -> None:
        """The first observation of a bucket is a warm-up (cold caches, a graph compiled) and is not kept."""
        key = bucket(size)
        self.timings += 1
        if key not in self.seen:
            self.seen.add(key)
            return
        window = self.window.setdefault(key, deque(maxlen=COST_WINDOW))
        if self.timings - self.measured_at.get(key, self.timings) > REFRESH_AFTER:
            window.clear()  # timed again after a long while (`REFRESH_AFTER`): what it cost then is not current
        window.append((size, seconds))
        self.points[key] = (median([x for x, _ in window]), median([y for _, y in window]))
        self.measured_at[key] = self.timings
        stale = [k for k, t in self.measured_at.items() if self.timings - t > STALE_AFTER]
        for k in stale:
            del self.points[k], self.measured_at[k], self.window[k]
        self._lists = self._xy = None

    def known(self, size: int) -> bool:
        return bucket(size) in self.points

    def age(self, size: int) -> int:
        """Timings of this curve since `size`'s bucket was last measured (0 if it never was: an unmeasured size is
        priced optimistically, so the plan tries it anyway)."""
        at = self.measured_at.get(bucket(size))
        return 0 if at is None else self.timings - at

    def settled(self, size: int) -> bool:
        """Timed often enough that one cold timing cannot set its price."""
        return len(self.window.get(bucket(size), ())) >= SETTLED

    def __call__(self, sizes):
        """Seconds at `sizes` (a number or an array): piecewise-linear through the measured points (made
        non-decreasing), below them the first segment's slope (never below zero; with one point, proportional),
        above them flat: an optimistic guess, so the plan tries the size and measures it. (The last segment's
        slope extrapolated the noise of two tiny sizes: a context write of 1 and 2 positions, 0.6 and 1.7 ms,
        priced 36 positions at 36 ms against 2.4 ms measured, and the plan never drafted again to see it.)
        None before any point was measured."""
        if not self.points:
            return None
        if self._lists is None:  # in plain Python: the curve changes every cycle, and numpy costs ~30 us a build
            pts = sorted(self.points.values())
            # more work never takes less time: a size measured in a bad moment and not since (the plan avoids it
            # because it looked slow) is capped by the larger sizes measured after it
            ys, low = [], math.inf
            for _, y in reversed(pts):
                low = min(low, y)
                ys.append(low)
            self._lists = [float(x) for x, _ in pts], ys[::-1]
        if isinstance(sizes, NUMBER):  # the same line in plain Python: numpy costs ~30 us per call
            return self._at(float(sizes))
        if self._xy is None:
            self._xy = np.array(self._lists[0]), np.array(self._lists[1])
        xs, ys = self._xy
        sizes = np.asarray(sizes, dtype=np.float64)
        if len(xs) == 1:
            return ys[0] * np.minimum(1.0, sizes / xs[0])
        low = ys[0] + max(0.0, (ys[1] - ys[0]) / max(xs[1] - xs[0], 1e-9)) * (sizes - xs[0])
        inside = np.interp(sizes, xs, ys)  # flat beyond the last point
        return np.maximum(0.0, np.where(sizes < xs[0], low, inside))

    def _at(self, size: float) -> float:
        xs, ys = self._lists
        if len(xs) == 1:
            return ys[0] * min(1.0, size / xs[0])
        if size < xs[0]:
            return max(0.0, ys[0] + max(0.0, (ys[1] - ys[0]) / max(xs[1] - xs[0], 1e-9)) * (size - xs[0]))
        if size > xs[-1]:
            return ys[-1]
        i = max(1, bisect_left(xs, size))
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 if x1 == x0 else y0 + (y1 - y0) * (size - x0) / (x1 - x0))

    def slope(self, size: float) -> float:
        """d seconds / d size near `size` (0 when unknown)."""
        if not self.points:
            return 0.0
        a, b = self([size, size + 1])
        return float(b - a)


class Goodput:
    """Committed tokens per second that drafting cycles and cycles of one-token steps actually gave, per
    power-of-two bucket of batch rows; a bucket where drafting gave less is held at one-token steps.

    Why: the plan maximises predicted throughput, and its predictions err towards drafting under load: rows
    draft when their estimates are high, so they accept less than the estimates that chose them (28 % less at 16
    served rows), probes are judged on an optimistic prior, one-token steps are priced from cost buckets keyed
    by tokens verified, which also hold one row's block verify, and a row's draft also writes the context it has
    not drafted on (its prompt, its one-token steps), which the draft curve by rows does not price. Each error
    alone is small; together they kept a CPU server drafting at loads where every drafting cycle lost. Measured
    goodput has none of these errors: it is what the plans did (probes included) against what one-token steps
    did, at the same load. Drafting is
    judged again after each hold, so a bucket where it pays again (a faster drafter, a quieter machine, better
    prompts) drafts again within one hold."""

    def __init__(self):
        self.drafting: dict[int, deque] = {}  # bucket -> (committed tokens, seconds) of its last drafting cycles
        self.plain: dict[int, deque] = {}  # bucket -> the same of its last cycles of one-token steps
        self.fresh: dict[int, int] = {}  # drafting cycles since the bucket was last judged
        self.hold: dict[int, int] = {}  # one-token-step cycles the bucket has left to hold
        self.next_hold: dict[int, int] = {}
        self.lost: dict[int, bool] = {}  # the bucket's last judgement: drafting gave less

    def allows(self, rows: int) -> bool:
        key = bucket(rows)
        if rows < GOODPUT_ROWS:
            return True
        if key not in self.lost:  # never judged: start from the nearest smaller load's verdict (on CPU drafting
            smaller = [k for k in self.lost if k < key]  # only loses more with load), held first if drafting lost
            if smaller and self.lost[max(smaller)]:
                self.lost[key], self.hold[key] = True, MIN_HOLD
        return not self.holding(rows)

    def holding(self, rows: int) -> bool:
        """Whether this load is held at one-token steps now (read-only: `allows` also starts a new load's hold);
        below GOODPUT_ROWS rows never."""
        return rows >= GOODPUT_ROWS and self.hold.get(bucket(rows), 0) > 0

    def record(self, rows: int, committed: int, seconds: float, drafting: bool, plain_s: float | None) -> None:
        """One cycle of `rows` rows that committed `committed` tokens in `seconds`; `plain_s`: what the cost model
        says a one-token step of these rows takes (the reference while too few were measured: a bucket where every
        cycle drafts has none)."""
        key = bucket(rows)
        if not drafting:
            self.plain.setdefault(key, deque(maxlen=PLAIN_WINDOW)).append((committed, seconds))
            self.hold[key] = max(0, self.hold.get(key, 0) - 1)
            return
        self.drafting.setdefault(key, deque(maxlen=DRAFTING_WINDOW)).append((committed, seconds))
        self.fresh[key] = self.fresh.get(key, 0) + 1
        plain_rate = reference_rate(self.plain.get(key, ()), rows, plain_s)
        if self.fresh[key] < max(2, JUDGED_ROWS // key) or plain_rate is None:
            return
        self.fresh[key] = 0
        window = self.drafting[key]
        self.lost[key] = rate(window) < HOLD_BELOW * plain_rate
        if self.lost[key]:
            hold = self.next_hold.get(key, MIN_HOLD)
            # lost its last judgement too (a first loss may be an early plan's: hold briefly); that loss cleared the
            # window, so it holds this judgement's drafting cycles only
            if hold > MIN_HOLD:
                shortfall_s = sum(s for _, s in window) - sum(t for t, _ in window) / plain_rate
                hold = max(hold, math.ceil(shortfall_s * plain_rate / (JUDGEMENT_SHARE * rows)))  # in cycles
            start_hold(self.hold, self.next_hold, key, hold)
            window.clear()  # after the hold, drafting is judged on what it does then
        else:
            self.next_hold[key] = MIN_HOLD


class LookupGoodput:
    """Committed tokens per second of cycles whose one-token steps verified prompt-lookup copies, against cycles of
    bare one-token steps, per power-of-two bucket of batch rows from GOODPUT_ROWS rows; a bucket where the copies
    gave less searches no copies for a hold (MIN_HOLD bare cycles, doubling up to MAX_HOLD while they keep losing),
    then is judged again.

    Why: a copy is priced by the body curve's extra seconds per verified token, but where a step is overhead-bound
    (a bf16 target on a CPU with AMX) 16 rows of which a few verify copies ran the ragged forward in 12-16 ms against
    7.4 ms for 16 bare one-token steps, while the curve, whose 17-32-token bucket also held 2-row block cycles of
    the warm-up, priced four extra tokens at 0 ms; cycles with copies gave 11 % fewer tokens per second than bare
    ones, and rows that took copies ran out of step with the others (they finish apart, their successors join one
    by one). Measured per cycle, the copies' yield has none of the curve's errors. Below GOODPUT_ROWS rows
    (batch 1, where copies gain most: out-of-domain prompts at one request) nothing is held."""

    def __init__(self):
        self.copies: dict[int, deque] = {}  # bucket -> (committed tokens, seconds) of its last cycles with copies
        self.bare: dict[int, deque] = {}  # the same of its last cycles of one-token steps without copies
        self.fresh: dict[int, int] = {}  # cycles with copies since the bucket was last judged
        self.hold: dict[int, int] = {}  # bare cycles the bucket has left to hold
        self.next_hold: dict[int, int] = {}

    def allows(self, rows: int) -> bool:
        return rows < GOODPUT_ROWS or self.hold.get(bucket(rows), 0) == 0

    def record(self, rows: int, committed: int, seconds: float, copies: bool, plain_s: float | None) -> None:
        """A cycle of `rows` rows at one-token steps (no draft) that committed `committed` tokens in `seconds`, with
        or without copies; `plain_s`: the cost model's one-token step of these rows (the reference while fewer than
        PLAIN_REFERENCE bare cycles were measured)."""
        if rows < GOODPUT_ROWS:
            return
        key = bucket(rows)
        if not copies:
            self.bare.setdefault(key, deque(maxlen=PLAIN_WINDOW)).append((committed, seconds))
            self.hold[key] = max(0, self.hold.get(key, 0) - 1)
            return
        window = self.copies.setdefault(key, deque(maxlen=DRAFTING_WINDOW))
        window.append((committed, seconds))
        self.fresh[key] = self.fresh.get(key, 0) + 1
        bare_rate = reference_rate(self.bare.get(key, ()), rows, plain_s)
        if self.fresh[key] < max(LOOKUP_JUDGED, JUDGED_ROWS // key) or bare_rate is None:
            return
        self.fresh[key] = 0
        if rate(window) < HOLD_BELOW * bare_rate:
            start_hold(self.hold, self.next_hold, key, self.next_hold.get(key, MIN_HOLD))
            window.clear()  # after the hold, copies are judged on what they give then
        else:
            self.next_hold[key] = MIN_HOLD


def rate(window) -> float:
    """Tokens per second over a window of (tokens, seconds)."""
    return sum(t for t, _ in window) / max(sum(s for _, s in window), 1e-12)


def reference_rate(window, rows: int, plain_s: float | None) -> float | None:
    """What one-token steps of `rows` rows commit per second: measured over `window` (tokens, seconds) once it holds
    PLAIN_REFERENCE cycles, else by the cost model's `plain_s` (None without either)."""
    return rate(window) if len(window) >= PLAIN_REFERENCE else rows / plain_s if plain_s else None


def start_hold(hold: dict[int, int], next_hold: dict[int, int], key: int, cycles: int) -> None:
    """Hold bucket `key` for `cycles` cycles (at most MAX_HOLD); its next hold is twice that (at most MAX_HOLD)."""
    hold[key] = min(cycles, MAX_HOLD)
    next_hold[key] = min(2 * hold[key], MAX_HOLD)


class CostModel:
    """An engine's measured cycle costs: the cycle without its draft (target forward, verify, commit) by tokens
    verified, the draft by positions drafted (drafting rows x the block drafted: on CPU a draft of 16 rows x 4
    positions costs what one of 4 x 16 does, within 5 %); and the goodput the plans gave (`Goodput`)."""

    def __init__(self):
        self.body, self.draft, self.context = Curve(), Curve(), Curve()
        self.goodput = Goodput()
        self.lookups = LookupGoodput()
        self.search_s: float | None = None  # seconds a row's lookup search takes (a moving average)

    def record_search(self, rows: int, seconds: float) -> None:
        per_row = seconds / rows
        self.search_s = per_row if self.search_s is None else self.search_s + SMOOTHING * (per_row - self.search_s)

    def record(self, t: CycleTiming) -> None:
        self.body.record(t.verified_tokens, max(0.0, t.total_s - t.draft_s - t.context_s))
        if t.drafted_tokens:
            self.draft.record(t.drafted_tokens, t.draft_s)
        if t.context_tokens:
            self.context.record(t.context_tokens, t.context_s)

    def context_write(self, positions):
        """Predicted seconds of writing pending context (rows x longest pending) into the drafter; 0 for none,
        and while no write was measured (then the plan drafts and measures one)."""
        if not self.context.points:
            return 0.0 if isinstance(positions, NUMBER) else np.zeros(np.shape(positions))
        if isinstance(positions, NUMBER):
            return self.context(positions) if positions else 0.0
        return np.where(np.asarray(positions) > 0, self.context(positions), 0.0)

    def settled(self, verified_tokens: int, drafted_tokens: int) -> bool:
        """Whether a cycle's target side and draft are priced by settled buckets. The context write is not checked:
        its size follows each row's pending positions, so most of its buckets stay unsettled and every probe
        would draft."""
        return self.body.settled(verified_tokens) and self.draft.settled(drafted_tokens)

    def cycle(self, verified_tokens, drafted_tokens, context_tokens=0):
        """Predicted seconds of cycles (numbers or arrays of verified and drafted tokens, and of pending context
        written first); None while a part they need was never measured."""
        body = self.body(verified_tokens)
        if body is not None:
            body = body + self.context_write(context_tokens)
        if isinstance(drafted_tokens, NUMBER) and isinstance(verified_tokens, NUMBER):
            if body is None or not drafted_tokens:
                return body
            return None if not self.draft.points else body + self.draft(drafted_tokens)
        drafted_tokens = np.asarray(drafted_tokens)
        draft = self.draft(np.maximum(drafted_tokens, 1)) if self.draft.points else None
        if body is None or (draft is None and drafted_tokens.any()):
            return None
        return body + (np.where(drafted_tokens > 0, draft, 0.0) if draft is not None else 0.0)


def trimmed_width(survival: np.ndarray, choices: list[int], per_token: float) -> int:
    """The verify width, among `choices` (drafting widths, > 1) up to 1 + len(survival) or 1, whose expected
    accepted drafts (the sum of the survivals of the drafts it verifies) minus `per_token` per draft verified is the
    largest."""
    best, best_net = 1, 0.0
    expected = np.cumsum(survival).tolist()  # expected[j]: accepted drafts expected of the first j + 1
    for c in choices:
        if c - 1 > len(expected):
            break
        net = expected[c - 2] - per_token * (c - 1)
        if net > best_net:
            best, best_net = c, net
    return best


def reached(width: int, accepted: int) -> int:
    """Draft positions a cycle verified with every draft before them accepted: what it says about acceptance."""
    return min(accepted + 1, width - 1)


def outcomes(width: int, accepted: int, imputed: np.ndarray | None = None) -> np.ndarray:
    """What a draft verified at `width` says about its positions, from the first: 1 for each accepted, 0 for the
    first rejected (if verified); then `imputed`: the calibrated confidence of the positions a confidence trim left
    unverified after an accepted prefix (`AdaptiveWidth.trim`), their acceptance as far as anything tells."""
    n = reached(width, accepted)
    seen = (accepted > np.arange(n)).astype(np.float64)
    return seen if imputed is None or not len(imputed) else np.concatenate([seen, imputed])


def smooth_acceptance(acceptance: np.ndarray, width: int, accepted: int, rate,
                      imputed: np.ndarray | None = None) -> None:
    """Move acceptance estimates towards what a draft verified at `width` showed (`outcomes`); positions after the
    first rejected one were not reached, so they keep their estimate. `rate`: one weight, or one per position
    `outcomes` gives."""
    seen = outcomes(width, accepted, imputed)
    acceptance[:len(seen)] += rate * (seen - acceptance[:len(seen)])


def expected_gains(acceptance: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Expected accepted drafts when verifying each of `widths` (> 1) tokens: the survivals of positions 1 .. w - 1
    (each the product of the acceptances up to it), summed."""
    return np.cumsum(np.cumprod(acceptance))[widths - 2]


class ConfidenceCalibration:
    """P(a draft is accepted | the drafts before it were) by the drafter's confidence c in it, per kind of row
    (greedy, sampled), in CONFIDENCE_BINS equal bins of c. A bin starts at its centre, the drafter's own word,
    counted as one draft, and is a mean of the drafts verified in it until it has seen 1 / PRIOR_SMOOTHING of them,
    then a moving average: a drafter's calibration is its own and drifts with the traffic (the shipped drafter's
    greedy p1 / (p1 + p2) is close to calibrated, ECE 0.03-0.06, its raced q at temperature 1 far from it, 0.26-0.28:
    drafts it gave 0.0-0.1 were accepted a third of the time; BENCHMARKS.md, 'Confidence trim')."""

    def __init__(self):
        centres = (np.arange(CONFIDENCE_BINS) + 0.5) / CONFIDENCE_BINS
        self.table = {False: centres.copy(), True: centres.copy()}
        self.seen = {False: np.ones(CONFIDENCE_BINS), True: np.ones(CONFIDENCE_BINS)}

    @staticmethod
    def bins(confidence: np.ndarray) -> np.ndarray:
        # two ufuncs, not np.clip (~4x their cost per call: this runs every drafting cycle)
        return np.minimum(np.maximum((confidence * CONFIDENCE_BINS).astype(np.int64), 0), CONFIDENCE_BINS - 1)

    def __call__(self, sampled: bool, confidence: np.ndarray) -> np.ndarray:
        return self.table[sampled][self.bins(confidence)]

    def update(self, sampled: bool, confidence: np.ndarray, accepted: np.ndarray) -> None:
        """Drafts verified with every draft before them accepted: their confidence and whether each was accepted."""
        table, seen = self.table[sampled], self.seen[sampled]
        for b, ok in zip(self.bins(confidence).tolist(), accepted.tolist()):
            seen[b] += 1
            table[b] += max(PRIOR_SMOOTHING, 1.0 / seen[b]) * (ok - table[b])


class AcceptancePriors:
    """What new rows start from, one for greedy and one for sampled rows: the engine-wide acceptance per draft
    position, a slow moving average over every row's drafts; and, for sampled rows, the wait before a row's first
    probe: the wait the last sampled row set itself by drafting (so where probes keep losing, at temperature 1
    with a weak drafter, a new request does not lose its first few probes again: each costs ~2 one-token steps at
    batch 1 on CPU). Greedy rows do not inherit it: greedy acceptance belongs to the prompt (out of domain, a
    prompt's tau under the fixed block ranges 1.0-9.9), and after a few failing requests the inherited 128-step
    wait left 7 good ones in a row (fixed-block tau 4.6-7.4) without a single draft at batch 1.

    A row's FIRST draft is priced apart, by the lower of `first` (learnt from first drafts only, a mean until it
    has seen 1 / PRIOR_SMOOTHING of them) and the prior of all drafts: it is usually the answer's first
    block, which the drafter predicts from the prompt alone, and the shipped drafter accepts 1.5-2.8 tokens there
    against 3.6-7.2 over the whole answer. Priced by the prior of all drafts, a server's first plan for 16 fresh
    greedy rows drafted them all at width 8 and accepted 2 drafts a row (a cycle trace of that load). After its
    first draft a row continues, as before, from the prior of all drafts (`by_kind`) updated by what it saw."""

    def __init__(self, block_size: int):
        self.by_kind = {False: initial_prior(block_size), True: initial_prior(block_size)}
        self.first = {False: initial_prior(block_size), True: initial_prior(block_size)}
        # drafts that reached each position, for the priors learnt as a mean at first: sampled rows' (all drafts),
        # first drafts' (per kind), sampled rows' lookup continuations
        self.seen = {kind: np.zeros(block_size - 1) for kind in ("sampled", False, True, "lookup")}
        self.sampled_wait = MIN_PLAIN_RUN
        # prompt-lookup continuations verified at one-token steps, greedy and sampled rows apart (a sampled row's
        # continuation survives only where the target's own sample follows the copy)
        self.lookup = {False: initial_prior(block_size), True: initial_prior(block_size)}
        # lookup tokens accepted per row searched for a copy, per kind, and the searches behind it (the optimistic
        # start, one token, counting as one)
        self.search_yield = {False: 1.0, True: 1.0}
        self.searches = {False: 1, True: 1}
        self.calibration = ConfidenceCalibration()  # of the drafter's confidence in each draft (`AdaptiveWidth.trim`)
        # the share of a row's drafts its confidence trim verifies, by the width planned (index = width), per kind:
        # what plans price a drafting row's verify by (1 until trims were seen; a mean, then a moving average)
        self.verified_share = {False: np.ones(block_size + 1), True: np.ones(block_size + 1)}
        self.trims_seen = {False: np.zeros(block_size + 1), True: np.zeros(block_size + 1)}

    def __getitem__(self, sampled: bool) -> np.ndarray:
        return self.by_kind[sampled]

    def update(self, sampled: bool, width: int, accepted: int, first: bool = False,
               imputed: np.ndarray | None = None) -> None:
        """A draft of a row of this kind (`first`: the row's first) that accepted `accepted` of `width` - 1
        (`imputed`: as `outcomes`)."""
        n = len(outcomes(width, accepted, imputed))
        rate = self._mean_rate(self.seen["sampled"], n) if sampled else PRIOR_SMOOTHING
        smooth_acceptance(self.by_kind[sampled], width, accepted, rate, imputed)
        if first:
            smooth_acceptance(self.first[sampled], width, accepted, self._mean_rate(self.seen[sampled], n), imputed)

    def update_lookup(self, sampled: bool, width: int, accepted: int) -> None:
        """A lookup continuation verified at a one-token step; the sampled rows' lookup prior is a mean at first, as
        their drafts' is (at temperature 1 a copy is rarely the target's sample: moving slowly from 0.9, the prior
        kept new rows verifying copies through a whole served load)."""
        rate = self._mean_rate(self.seen["lookup"], reached(width, accepted)) if sampled else PRIOR_SMOOTHING
        smooth_acceptance(self.lookup[sampled], width, accepted, rate)

    def update_share(self, sampled: bool, planned: int, verified: int) -> None:
        """A row of this kind planned at `planned` verified `verified` after its confidence trim."""
        seen = self.trims_seen[sampled]
        seen[planned] += 1
        share = self.verified_share[sampled]
        share[planned] += max(PRIOR_SMOOTHING, 1.0 / seen[planned]) * ((verified - 1) / (planned - 1) - share[planned])

    def update_search(self, sampled: bool, searches: int, gained: int) -> None:
        """`searches` rows of this kind were searched for a copy and their copies gave `gained` accepted tokens."""
        self.searches[sampled] += searches
        weight = searches / min(self.searches[sampled], SEARCH_MEMORY)
        self.search_yield[sampled] += min(1.0, weight) * (gained / searches - self.search_yield[sampled])

    @staticmethod
    def _mean_rate(seen: np.ndarray, n: int):
        """For a draft that says something about its first n positions: a mean of the drafts that did so at each
        position (the optimistic start counting as one) until it has seen 1 / PRIOR_SMOOTHING of them, then a
        moving average."""
        seen[:n] += 1
        return np.maximum(PRIOR_SMOOTHING, 1.0 / (seen[:n] + 1))


@dataclass
class RowAcceptance:
    """One row's acceptance estimates and its probe schedule."""

    acceptance: np.ndarray  # acceptance[i]: estimated P(draft i+1 is accepted | drafts 1 .. i were), i = 0 .. k-2
    sampled: bool = False  # temperature > 0 (which prior it learns into)
    plain_steps: int = 0  # one-token steps since the row last drafted
    plain_run: int = MIN_PLAIN_RUN  # one-token steps before the next probe
    probing: bool = False
    judged: np.ndarray | None = None  # the estimates a probe replaced by the prior (restored if it loses)
    planned: bool = True  # judged by a plan since it joined the batch
    first: bool = False  # has not drafted yet: `acceptance` is priced as a first draft (`AcceptancePriors.first`)
    # the same estimates for prompt-lookup continuations verified at one-token steps (`lookup_widths`)
    lookup: np.ndarray | None = None
    # this cycle's confidence trim (`AdaptiveWidth.trim`), until `observe`: the drafter's confidence in each draft
    # up to the planned width, and the width verified (0: not trimmed)
    confidence: np.ndarray | None = None
    trimmed_to: int = 0

    def gains(self, widths: np.ndarray) -> np.ndarray:
        return expected_gains(self.acceptance, widths)

    def update(self, width: int, accepted: int, imputed: np.ndarray | None = None) -> None:
        smooth_acceptance(self.acceptance, width, accepted, SMOOTHING, imputed)


class FixedWidth:
    """Every row verifies the full block every cycle. The cycle costs are still measured (when given a cost model):
    token trees size themselves by them (`tree_budget="auto"`)."""

    decision = "fixed"  # how every cycle's widths are decided (a cycle trace reads it)

    def __init__(self, block_size: int, costs: CostModel | None = None):
        self.block_size = block_size
        self.costs = costs

    def new_row(self, sampled: bool = False) -> None:
        return None

    def widths(self, rows: list, pending: list[int] | None = None) -> list[int]:
        return [self.block_size] * len(rows)

    def observe(self, rows: list, widths: list[int], accepted: list[int], timing: CycleTiming | None) -> None:
        """`timing` None: a cycle the cost model must not learn from (one the engine prices apart)."""
        if self.costs is not None and timing is not None:
            self.costs.record(timing)


class AdaptiveWidth:
    """Widths that maximise expected committed tokens per second; see the module docstring."""

    def __init__(self, block_size: int, costs: CostModel, ragged: bool, priors: AcceptancePriors | None = None,
                 choices: tuple[int, ...] | None = None, drafts_to_width: bool = False):
        self.block_size = block_size
        self.costs = costs
        self.ragged = ragged  # rows verify their own widths in one forward (else all are padded to the widest)
        self.drafting_widths = np.array((choices or width_choices(block_size))[1:])
        # positions the drafter fills when the widest drafting row verifies each width: that width where drafts
        # stop there (`drafts_to_width`), else the whole block
        self.draft_lengths = self.drafting_widths if drafts_to_width else np.full_like(self.drafting_widths,
                                                                                        block_size)
        # the engine-wide priors of new rows (shared by the engine's batches when passed in)
        self.priors = priors if priors is not None else AcceptancePriors(block_size)
        # a plan of one-token steps only is kept for REPLAN_PLAIN_EVERY cycles while the batch stays in its row
        # bucket: rows that join meanwhile are judged alone (`_newcomers_draft`), rows that leave change nothing
        self._plain_cycles_left, self._plain_bucket = 0, 0
        self._turned_away = {False: 0, True: 0}  # rows the lookup search gate turned away, modulo SEARCH_PROBE_EVERY
        # how the last `widths` decided, for a cycle trace: "plan" (the cost and acceptance models chose), "kept"
        # (a plan of one-token steps still stands), "probe" (it stands but for a probed row, which drafts), "held"
        # (the goodput check holds this load at one-token steps: drafting lately gave less), "refresh" (a plan or
        # probe whose drafting row verifies the block to re-time its price, `_refresh`), "unmeasured" /
        # "unmeasured load" (no cycle timed yet / none of this many rows)
        self.decision: str | None = None
        self._timing = False  # this cycle's widths were chosen to time a cycle size: `trim` leaves them
        self._since_untrimmed = 0  # drafting rows trimmed since one was left untrimmed (`CALIBRATE_EVERY`)

    def new_row(self, sampled: bool = False) -> RowAcceptance:
        # a first draft is priced by the lower of the two priors: while few first drafts were seen, theirs is still
        # near the optimistic start
        return RowAcceptance(np.minimum(self.priors.first[sampled], self.priors[sampled]), sampled,
                             plain_run=self.priors.sampled_wait if sampled else MIN_PLAIN_RUN, planned=False,
                             first=True, lookup=self.priors.lookup[sampled].copy())

    def _wait(self, r: RowAcceptance, plain_run: int) -> None:
        r.plain_run = plain_run
        if r.sampled:
            self.priors.sampled_wait = plain_run

    # ---- the plan -------------------------------------------------------------------------------------------

    def widths(self, rows: list[RowAcceptance], pending: list[int] | None = None) -> list[int]:
        """One verify width per row; `pending`: per row, the context positions its draft would write first (the
        target features of what it committed since it last drafted)."""
        n = len(rows)
        # a row left at one-token steps long enough is probed: judged optimistically once. One probe per cycle:
        # rows that join together come due together, and probed all at once the optimistic prior priced drafting
        # for the whole batch (16 rows on CPU: 16 drafting rows in a 63 ms cycle that gave a third less than
        # one-token steps); one at a time, each is judged on what drafting that one row costs
        due = [i for i, r in enumerate(rows) if r.plain_steps >= r.plain_run and not r.probing]
        probe, self._timing = None, False
        if due and not any(r.probing for r in rows):
            probe = max(due, key=lambda i: rows[i].plain_steps - rows[i].plain_run)  # the longest overdue first
            r = rows[probe]
            r.judged, r.acceptance, r.probing = r.acceptance, initial_prior(self.block_size), True
        if not self.costs.body.points:  # nothing measured yet: draft, then judge
            self.decision, self._timing = "unmeasured", True
            return [self.block_size] * n
        if not self.costs.body.known(n):  # a one-token step of this many rows was never measured
            self.decision = "unmeasured load"
            return [1] * n
        kept = self._plain_cycles_left > 0 and bucket(n) == self._plain_bucket
        joined = [i for i, r in enumerate(rows) if not r.planned] if kept else []
        if kept:
            self._plain_cycles_left -= 1  # nothing it judged has changed since it chose one-token steps
            if probe is None and not joined:
                self.decision = "held" if self.costs.goodput.holding(n) else "kept"
                return [1] * n
        pending = np.zeros(n, dtype=np.int64) if pending is None else np.asarray(pending, dtype=np.int64)
        plan = np.ones(n, dtype=np.int64)
        if not self.costs.goodput.allows(n):  # drafting gave less than one-token steps at this load, lately
            self.decision = "held"  # every row steps (a probe among them is declined below)
        elif kept and self.ragged and not self._newcomers_draft(rows, joined, n, pending):
            self.decision = "kept"
            # the plan kept stands for the rows that joined (a full plan costs ~5 % of a 16-row step, and with
            # 64-token requests at 16 rows a row joins every ~2 cycles); a probe drafts if drafting it alone pays
            for i in joined:
                rows[i].planned = True
            if probe is None:
                return plan.tolist()
            plan[probe] = self._alone(rows[probe].gains(self.drafting_widths), n, int(pending[probe]),
                                      self._verified_drafts(rows[probe]))
            self._explore(plan, probe, n)
            if plan[probe] == 1:
                self._declined(rows[probe])
                return plan.tolist()
            self.decision = "probe"  # the kept plan stands but for the probed row, which drafts
            if self._refresh(plan, rows):
                self.decision = "refresh"
        else:
            self.decision = "plan"
            self._reprice_untested(rows)
            plan = self._plan(np.stack([r.gains(self.drafting_widths) for r in rows]), pending,
                              np.stack([self._verified_drafts(r) for r in rows]))
            self._cap_untested(plan, rows, pending)
            self._explore(plan, probe, n)
            if self._refresh(plan, rows):
                self.decision = "refresh"
        for r, w in zip(rows, plan):
            r.planned = True
            if r.probing and w == 1:
                self._declined(r)
        drafting = bool((plan > 1).any())
        self._plain_cycles_left, self._plain_bucket = (0 if drafting else REPLAN_PLAIN_EVERY - 1), bucket(n)
        return plan.tolist()

    def _reprice_untested(self, rows: list[RowAcceptance]) -> None:
        """Rows that have not drafted yet are priced by the first-draft prior as it is now, not as it was when they
        joined: other rows' first drafts may have taught it since (a whole first wave joins on the optimistic start)."""
        current = {}
        for r in rows:
            if r.first:
                if r.sampled not in current:
                    current[r.sampled] = np.minimum(self.priors.first[r.sampled], self.priors[r.sampled])
                if r.probing:
                    r.judged = current[r.sampled].copy()
                else:
                    r.acceptance = current[r.sampled].copy()

    def _cap_untested(self, plan: np.ndarray, rows: list[RowAcceptance], pending: np.ndarray) -> None:
        """Of the rows a plan drafts on the first-draft prior alone, at most UNTESTED_PER_FIRST_DRAFT per first
        draft that prior has seen (as many before any) draft in this cycle, per kind; the others step, to be planned
        again next cycle on a prior that has learnt from these. The optimistic start is a bet worth making on a row
        or two (at batch 1 a failed draft costs ~2 one-token steps), not on a whole first wave: 64 fresh greedy rows
        on CPU drafted 63 rows at width 8 on it, accepted 1.5 drafts a row in a cycle of 7 one-token steps' time
        (0.89x plain decoding over the cell's first round). Where rows join one by one the cap rarely binds; with
        a padded forward (every row one width) it does not apply."""
        if not self.ragged:
            return
        for sampled in (False, True):
            untested = [i for i, r in enumerate(rows)
                        if plan[i] > 1 and r.first and not r.probing and r.sampled == sampled]
            allowed = int(max(1, self.priors.seen[sampled][0]) * UNTESTED_PER_FIRST_DRAFT)
            for i in sorted(untested, key=lambda i: pending[i])[allowed:]:  # the cheapest contexts to write first
                plan[i] = 1

    def _newcomers_draft(self, rows: list[RowAcceptance], joined: list[int], n: int, pending: np.ndarray) -> bool:
        """Whether a row that joined since the last plan would draft alone beside n - 1 one-token steps, judged on
        its own (the prior's) estimates. One row per kind is judged: rows of a kind start from the same prior, and
        the one with the least pending context costs least to draft."""
        for sampled in {rows[i].sampled for i in joined}:
            i = min((i for i in joined if rows[i].sampled == sampled), key=lambda i: pending[i])
            r = rows[i]
            if self._alone(r.gains(self.drafting_widths), n, int(pending[i]), self._verified_drafts(r)) > 1:
                return True
        return False

    def _explore(self, plan: np.ndarray, probe: int | None, n: int) -> None:
        """A probe the plan declined drafts the block anyway (every row, where rows share one width) while the
        cycle it needs is priced by an unsettled size (`_unsettled`)."""
        if probe is not None and plan[probe] == 1 and self._unsettled(n):
            plan[probe if self.ragged else slice(None)] = self.block_size
            self._timing = True

    def _refresh(self, plan: np.ndarray, rows: list[RowAcceptance]) -> bool:
        """Re-time the block's price when it is old (`REFRESH_AFTER`): the drafting row of the plan that would gain
        most from verifying the block instead of its narrower width (at least one token) verifies the block (with
        rows padded to one width, every drafting row). Returns whether it did."""
        block = self.block_size
        narrower = [i for i, w in enumerate(plan.tolist()) if 1 < w < block]
        if not narrower:
            return False
        column = {w: j for j, w in enumerate(self.drafting_widths.tolist())}

        def extra(i: int) -> float:  # expected drafts accepted at the block beyond those at the row's width
            gains = rows[i].gains(self.drafting_widths)
            return float(gains[-1] - gains[column[int(plan[i])]])

        gained = {i: extra(i) for i in narrower}
        i = max(narrower, key=gained.get)
        if gained[i] < 1.0:
            return False
        drafting = int((plan > 1).sum())
        verified = int(plan.sum()) - int(plan[i]) + block if self.ragged else len(plan) * block
        if max(self.costs.body.age(verified), self.costs.draft.age(drafting * int(self.draft_lengths[-1]))) \
                <= REFRESH_AFTER:
            return False
        if self.ragged:
            plan[i] = block
        else:
            plan[plan > 1] = block
        self._timing = True
        return True

    def _unsettled(self, n: int) -> bool:
        """Whether a probe drafting the block (beside n - 1 one-token steps; padded: every row drafting) is priced by
        a cycle size timed fewer than SETTLED times. A probe the plan declines then drafts anyway and times it:
        probes come ever more rarely, so this explores a few times per size."""
        drafting = 1 if self.ragged else n
        return not self.costs.settled(n + drafting * (self.block_size - 1), drafting * int(self.draft_lengths[-1]))

    @staticmethod
    def _declined(r: RowAcceptance) -> None:
        """A probe the plan declined even judged optimistically: lost, no draft needed to know. The row's own
        wait doubles, not the one new rows inherit: a decline says the load does not pay (a hold, many rows),
        not that drafts fail, so new rows (maybe alone later) do not inherit it."""
        r.acceptance, r.probing, r.plain_steps = r.judged, False, 0
        r.plain_run = min(2 * r.plain_run, MAX_PLAIN_RUN)

    def _verified_drafts(self, r: RowAcceptance) -> np.ndarray:
        """The drafts a row planned at each drafting width is expected to verify: all of them, less what the
        confidence trim has been cutting at that width (`AcceptancePriors.verified_share`)."""
        return self.priors.verified_share[r.sampled][self.drafting_widths] * (self.drafting_widths - 1)

    def _alone(self, gains: np.ndarray, n: int, pending: int, drafts: np.ndarray) -> int:
        """The width at which one row drafting beside n - 1 one-token steps gives the most expected tokens per
        second, 1 when none beats one-token steps for all (`drafts`: the drafts it would verify at each width)."""
        plain_s = self.costs.cycle(n, 0)
        best, best_rate = 1, n / plain_s if plain_s else 0.0
        for w, length, gain, verified in zip(self.drafting_widths.tolist(), self.draft_lengths.tolist(),
                                             gains.tolist(), drafts.tolist()):
            seconds = self.costs.cycle(n + verified, length, pending)
            if seconds and (n + gain) / seconds > best_rate:
                best, best_rate = w, (n + gain) / seconds
        return best

    def _plan(self, gains: np.ndarray, pending: np.ndarray, drafts: np.ndarray) -> np.ndarray:
        """The widths with the most expected committed tokens per second, from gains [n, widths] (expected
        accepted drafts of each row at each drafting width), each row's pending context positions [n] and the
        drafts it would verify at each width [n, widths] (`_verified_drafts`)."""
        n, widths = len(gains), self.drafting_widths
        if n == 1:  # one row: its best width, in plain Python (numpy's per-call overhead shows at batch 1 on CPU)
            return np.array([self._alone(gains[0], 1, int(pending[0]), drafts[0])])
        plain_s = self.costs.cycle(n, 0)
        plain_rate = n / plain_s if plain_s else 0.0
        if not self.ragged:  # every row verifies the same width
            seconds = self.costs.cycle(n * widths, n * self.draft_lengths, n * int(pending.max()))
            if seconds is None:
                return np.ones(n, dtype=np.int64)
            rates = (n + gains.sum(axis=0)) / np.maximum(seconds, 1e-12)
            j = int(rates.argmax())
            return np.full(n, widths[j]) if rates[j] > plain_rate else np.ones(n, dtype=np.int64)
        # the g rows that gain most at width w draft, the others take one-token steps: every (g, w) at once
        order = np.argsort(-gains, axis=0, kind="stable")
        gained = np.cumsum(np.take_along_axis(gains, order, axis=0), axis=0)  # [g - 1, widths]
        g = np.arange(1, n + 1)[:, None]
        context = g * np.maximum.accumulate(pending[order], axis=0)  # the g rows' pending, padded to the longest
        verified = n + np.cumsum(np.take_along_axis(drafts, order, axis=0), axis=0)
        seconds = self.costs.cycle(verified, g * self.draft_lengths, context)
        if seconds is None:
            return np.ones(n, dtype=np.int64)
        rates = (n + gained) / np.maximum(seconds, 1e-12)
        gi, j = np.unravel_index(int(rates.argmax()), rates.shape)
        best_rate = float(rates[gi, j])
        if best_rate <= plain_rate:
            return np.ones(n, dtype=np.int64)
        plan = np.ones(n, dtype=np.int64)
        plan[order[:gi + 1, j]] = widths[j]
        # then each row takes the width whose expected accepted drafts best pay for its cost at that rate:
        # max over w of gain(w) - rate x (drafts verified x seconds per verified token + seconds of its drafted
        # positions + seconds of writing its pending context)
        per_token = self.costs.body.slope(float(verified[gi, j]))
        per_drafted = self.costs.draft.slope(float((gi + 1) * self.draft_lengths[j]))
        per_context = self.costs.context.slope(float(context[gi, j])) if self.costs.context.points else 0.0
        net = gains - best_rate * (drafts * per_token + per_drafted * self.draft_lengths
                                   + per_context * pending[:, None])
        pick = net.argmax(axis=1)
        refined = np.where(net[np.arange(n), pick] > 0, widths[pick], 1)
        return refined if self._rate(gains, refined, pending, drafts) > best_rate else plan

    def _rate(self, gains: np.ndarray, plan: np.ndarray, pending: np.ndarray, drafts: np.ndarray) -> float:
        """Expected committed tokens per second of a ragged plan (0 while a cost it needs is unknown): every
        drafting row drafts as far as the widest one, and writes its context padded to the longest."""
        drafting = plan > 1
        rows = drafting.nonzero()[0]
        columns = np.searchsorted(self.drafting_widths, plan[drafting])
        drafted, context = 0, 0
        if drafting.any():
            drafted = int(drafting.sum() * self.draft_lengths[columns].max())
            context = int(drafting.sum() * pending[drafting].max())
        seconds = self.costs.cycle(len(plan) + float(drafts[rows, columns].sum()), drafted, context)
        if seconds is None or seconds <= 0:
            return 0.0
        return float((len(plan) + gains[rows, columns].sum()) / seconds)

    # ---- after the draft: the confidence trim --------------------------------------------------------------------

    def trim(self, rows: list[RowAcceptance], widths: list[int], confidence: dict[int, np.ndarray],
             drafted_tokens: int) -> list[int]:
        """Verify widths after the draft: each drafting row in `confidence` (row -> the drafter's confidence in each
        of its drafts) verifies the width, of the choices up to its planned one, whose expected accepted drafts best
        pay for their verification at the cycle's expected rate: the survival of draft j is the product of the
        calibrated confidences up to it (`ConfidenceCalibration`), and each verified token costs the target
        curve's slope at the plan's size times that rate (the draft is paid: only verification is weighed). A row
        verifies the bonus alone (width 1) when not even its first draft pays. Rows whose widths time a cycle size
        (`_timing`) and every CALIBRATE_EVERY-th drafting row keep their planned width."""
        trimmable = [i for i in confidence if widths[i] > 1]
        for i in trimmable:  # what their drafts show calibrates the confidence, trimmed or not (`observe`)
            rows[i].confidence = confidence[i][:widths[i] - 1]
        if self._timing or not self.ragged or not trimmable:
            return widths
        verified = int(sum(widths))
        seconds = self.costs.cycle(verified, drafted_tokens)
        if not seconds:
            return widths
        # expected committed tokens per second of the cycle as planned, on the rows' own estimates, and what a
        # verified draft costs: the target curve's mean slope over the sizes the trim can reach (the local slope
        # is 0 at the largest size timed, beyond which the curve is flat)
        committed = len(rows) + sum(float(expected_gains(rows[i].acceptance, np.array([w]))[0])
                                    for i, w in enumerate(widths) if w > 1)
        least = verified - sum(widths[i] - 1 for i in trimmable)
        body = self.costs.body  # timed (`seconds` above needs it)
        per_token = (committed / seconds) * (body(verified) - body(least)) / (verified - least)
        out = list(widths)
        for i in trimmable:
            self._since_untrimmed += 1
            if self._since_untrimmed >= CALIBRATE_EVERY:
                self._since_untrimmed = 0
                continue
            r = rows[i]
            survival = np.cumprod(self.priors.calibration(r.sampled, r.confidence))
            r.trimmed_to = out[i] = trimmed_width(survival, self.drafting_widths.tolist(), per_token)
        return out

    # ---- what happened ----------------------------------------------------------------------------------------

    def observe(self, rows: list[RowAcceptance], widths: list[int], accepted: list[int],
                timing: CycleTiming | None) -> None:
        if timing is not None:  # None: a cycle priced apart (`FixedWidth.observe`)
            self.costs.record(timing)
            drafted, copies = any(w > 1 for w in widths), timing.lookup_tokens > 0
            # the checks price drafting cycles and cycles with copies only
            plain_s = self.costs.cycle(len(rows), 0) if drafted or copies else None
            plain_s = None if plain_s is None else float(plain_s)
            committed = len(rows) + sum(accepted)
            self.costs.goodput.record(len(rows), committed, timing.total_s, drafted, plain_s)
            if not drafted:
                self.costs.lookups.record(len(rows), committed, timing.total_s, copies, plain_s)
        for r, w, a in zip(rows, widths, accepted):
            if w == 1:
                r.plain_steps += 1
                continue
            w, imputed = self._trimmed(r, w, a)
            first, r.first = r.first, False
            if first:  # from its first draft on, the row's estimates start from the prior of all drafts
                if r.probing:
                    r.judged = self.priors[r.sampled].copy()
                else:
                    r.acceptance = self.priors[r.sampled].copy()
            self.priors.update(r.sampled, w, a, first=first, imputed=imputed)
            if r.probing:  # a probe is evidence for the row's own estimates; the optimistic prior only bought it
                r.probing = False
                r.acceptance = r.judged
                # the wait doubles until the row drafts again on its own estimates: good drafts at a load where
                # drafting does not pay must not bring a probe every few steps
                self._wait(r, min(2 * r.plain_run, MAX_PLAIN_RUN))
            else:
                self._wait(r, MIN_PLAIN_RUN)
            r.plain_steps = 0
            r.update(w, a, imputed)

    def _trimmed(self, r: RowAcceptance, planned: int, accepted: int) -> tuple[int, np.ndarray | None]:
        """(the width a drafting row verified, the imputed acceptances of the drafts a confidence trim left
        unverified after an accepted prefix, or None); the calibration learns from the drafts it verified."""
        confidence, r.confidence = r.confidence, None
        trimmed, r.trimmed_to = r.trimmed_to, 0
        width = trimmed or planned
        if trimmed:
            self.priors.update_share(r.sampled, planned, width)
        if confidence is None:
            return width, None
        seen = outcomes(width, accepted)
        self.priors.calibration.update(r.sampled, confidence[:len(seen)], seen)
        if width == planned or accepted < width - 1:  # nothing unverified, or the trim cut after a rejection
            return width, None
        return width, self.priors.calibration(r.sampled, confidence[width - 1:])

    # ---- prompt lookup at one-token steps ------------------------------------------------------------------

    def lookup_widths(self, rows: list[RowAcceptance], lengths: list[int], widths: list[int]) -> list[int]:
        """For rows the plan left at one-token steps that have a prompt-lookup continuation of `lengths[i]`
        tokens: how many of its tokens to verify (0: none), the number whose expected accepted tokens (the sum
        of their survivals, each the product of the row's lookup acceptances up to it) beat, by the most, what
        the longer target forward costs at the batch's rate of one-token steps. On a CPU at batch 1 a verified
        token costs ~7 % of a step, so a row verifies nearly the whole copy; at 16 rows it costs a large share of
        a row's step, so only copies that keep being accepted are verified. No draft is priced: a copy costs no model
        call. Each row is priced beside the plan's widths alone (copies are rare enough to be judged apart)."""
        rate, total = self._plain_rate(widths)
        if rate is None:
            return [0] * len(rows)
        chosen = []
        for r, length in zip(rows, lengths):
            seconds = self.costs.body(total + np.arange(length + 1))
            net = np.concatenate([[0.0], np.cumsum(np.cumprod(r.lookup[:length]))]) - rate * (seconds - seconds[0])
            chosen.append(int(net.argmax()))
        return chosen

    def worth_looking_up(self, rows: list[RowAcceptance], widths: list[int]) -> list[bool]:
        """Per row at a one-token step, whether a copy could pay from its first token on: the row's estimate for a
        copy's first token above what one more verified token costs this cycle, in one-token steps' tokens. The
        engine searches only those rows' tokens (the search costs ~20 us a row in Python, and at temperature 1 the
        copies of 16 rows, rarely the target's sample, cost their cycles 2-4 % for almost no token), and only while
        searches of the row's kind give more tokens than they cost (`_search_pays`)."""
        rate, total = self._plain_rate(widths)
        if rate is None or not self.costs.lookups.allows(len(widths)):  # copies lately gave less at this load
            return [False] * len(rows)
        floor = rate * (self.costs.body(total + 1) - self.costs.body(total))
        return [float(r.lookup[0]) > floor and self._search_pays(r.sampled, rate) for r in rows]

    def _search_pays(self, sampled: bool, rate: float) -> bool:
        """Whether searching a row of this kind gives more tokens than the search's time buys at `rate` tokens per
        second; where it does not, every SEARCH_PROBE_EVERY-th such row still is (`SEARCH_PROBE_EVERY`)."""
        search_s = self.costs.search_s
        if search_s is None or self.priors.search_yield[sampled] >= search_s * rate:
            return True
        self._turned_away[sampled] = (self._turned_away[sampled] + 1) % SEARCH_PROBE_EVERY
        return self._turned_away[sampled] == 0

    def observe_searches(self, rows: list[RowAcceptance], gained: list[int], seconds: float) -> None:
        """Rows searched for lookup copies this cycle, the accepted tokens each one's copy gave (0: none found or
        verified), and the search's time."""
        self.costs.record_search(len(rows), seconds)
        for sampled in (False, True):
            mine = [g for r, g in zip(rows, gained) if r.sampled == sampled]
            if mine:
                self.priors.update_search(sampled, len(mine), sum(mine))

    def _plain_rate(self, widths: list[int]) -> tuple[float | None, int]:
        """What a lookup copy is priced against: the batch's tokens per second at one-token steps (None while such a
        step of this many rows was never timed), and the tokens the plan's widths verify."""
        plain_s = self.costs.cycle(len(widths), 0)
        return (len(widths) / plain_s if plain_s else None), int(sum(widths))

    def observe_lookups(self, rows: list[RowAcceptance], widths: list[int], accepted: list[int]) -> None:
        """What verifying lookup continuations of `widths` (bonus included) gave, for the rows' and the engine's
        lookup estimates (the rows' one-token steps themselves are `observe`'s)."""
        for r, w, a in zip(rows, widths, accepted):
            smooth_acceptance(r.lookup, w, a, SMOOTHING)
            self.priors.update_lookup(r.sampled, w, a)


DRAFT_POLICIES = ("adaptive", "fixed")


def new_policy(name: str, block_size: int, costs: CostModel | None = None, ragged: bool = True,
               priors: AcceptancePriors | None = None, choices: tuple[int, ...] | None = None,
               drafts_to_width: bool = False):
    """The policy a new batch of an engine with these settings starts with."""
    if name == "fixed" or block_size <= 1:
        return FixedWidth(block_size, costs)
    return AdaptiveWidth(block_size, costs if costs is not None else CostModel(), ragged, priors, choices,
                         drafts_to_width)
