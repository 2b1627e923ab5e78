"""Continuous batching: one thread owns the engine; requests join the live batch between cycles and leave when done.

Design. `SpecEngine` is not thread-safe, so exactly one scheduler thread touches it. Its loop, per iteration:
1. cancel  - rows whose clients went away are dropped from the batch (`engine.cancel`), freeing their cache rows;
2. admit   - waiting requests join the batch while it has free slots (`max_batch_size`), the prefill token
             budget allows, and (with `kv_cache_positions`, the server's `--kv-cache-memory`) the batch would fit
             the budget with room to grow: new ones ride step 4's cycle (`engine.step(batch, prompts, ...)`: their
             prompts go through the same target forward as the running rows' blocks) or, where they cannot
             (`engine.rides_cycle`: an empty batch, prompts past `--mixed-prefill-tokens`, exact mode, compiled
             steps, trees), `engine.add` (one prefill for all of them, first tokens out at once); preempted ones
             `engine.resume`;
3. preempt - (with a budget) while the batch's next cycle would take more than the budget, the running request
             that arrived last is preempted (`engine.preempt`) and goes back to the head of the queue;
4. step    - one draft/verify cycle for every row (`engine.step`); finished rows leave the batch;
5. deliver - each request's new tokens are handed to its asyncio queue with `loop.call_soon_threadsafe`.
With nothing to do the thread sleeps on a condition variable. Requests beyond the batch wait in a bounded queue,
first come first served (`policy="fcfs"`), or with `policy="priority"` (vLLM's) in order of each request's
`priority` (lower first), then arrival; `submit` on a full queue raises `QueueFull` at once (the server answers 429)
instead of blocking.
Memory: the engine's caches are paged; a batch takes, per row, its own committed tokens plus a block, in pages
(`flashdraft.memory.held_positions`; a sliding-window layer's only the pages its window reaches, counted at its
share of a position, `kv_shares`, once the row has run a cycle: a joining row holds its whole prompt); the engine's
pools, together, never grow past the budget's bytes unless rows need it (`SpecEngine.kv_page_limit`, a `KVBudget`,
set here). Admission counts what rows hold now with one page of growth each (capped at
what they may ever hold, prompt + max_tokens): the head of the queue joins only while that stays within
`kv_cache_positions`, otherwise it waits (later, smaller requests do not overtake it). Rows that outgrow the budget
anyway are preempted and recomputed, vLLM's policy: the latest arrival (under priorities: of the least urgent
priority) leaves the batch with everything it generated, waits at the head of the queue (of its priority), and when
it fits again its prompt and output are prefilled again and it goes on with the output it would have had
(`SpecEngine.resume`). A lone row always fits, because a request that could not fit even
alone, at prompt + max_tokens, is refused at `submit` (`TooLarge`, HTTP 400); so the batch always progresses.
Each request carries its own SamplingParams (temperature, stop ids/strings, max tokens); the engine applies them
per row, so mixing greedy and sampled requests in one batch is fine.

What this module does not know about: HTTP, JSON, tokenization, chat templates, the OpenAI format. It only sees
token ids, SamplingParams and request ids, and it reports through a `Metrics` object (or none).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from flashdraft.engine import SamplingParams, SpecEngine, StreamEvent
from flashdraft.memory import engine_bytes_per_position, held_positions, kv_shares, row_capacity
from flashdraft.model.slots import KVBudget

log = logging.getLogger("flashdraft.serve")


class QueueFull(Exception):
    """The waiting queue is at its bound; retry later (HTTP 429)."""


class TooLarge(ValueError):
    """The request's cache reservation alone exceeds the memory budget (HTTP 400)."""


class NotPrioritized(ValueError):
    """A request with a nonzero priority under first-come-first-served scheduling (HTTP 400)."""


class SchedulerClosed(Exception):
    """The scheduler is shutting down or has stopped (HTTP 503)."""


@dataclass
class Failure:
    """Delivered instead of an event when a request cannot be completed."""

    status: int
    message: str


@dataclass
class Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    priority: int = 0  # `policy="priority"`: lower is served first (vLLM's)
    first_token_at: float | None = None
    stats: object = None  # the engine's RequestStats of this request, once admitted
    preempted: object = None  # the engine's state of this request while it waits preempted (`engine.resume`)
    counted_cycles: int = 0  # drafting cycles already added to the spec-decode counters
    counted_steps: int = 0  # one-token steps already added
    counted_splices: int = 0  # chains continued by prompt lookup already added
    counted_lookups: tuple[int, int, int] = (0, 0, 0)  # lookup steps, their tokens verified and accepted, added

    @property
    def order(self) -> tuple[int, float]:
        """Where the request waits (and, running, how late it would be preempted): by priority, then arrival."""
        return self.priority, self.arrival


POLICIES = ("fcfs", "priority")


class Scheduler:
    def __init__(self, engine: SpecEngine, max_batch_size: int = 16, max_queue: int = 64,
                 max_prefill_tokens: int = 8192, metrics=None, threads: int | None = None,
                 kv_cache_positions: int | None = None, policy: str = "fcfs"):
        if max_batch_size < 1 or max_queue < 0:
            raise ValueError("max_batch_size must be >= 1 and max_queue >= 0")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        if kv_cache_positions is not None and kv_cache_positions < 1:
            raise ValueError(f"kv_cache_positions must be >= 1 or None, got {kv_cache_positions}")
        self.engine = engine
        self.kv_cache_positions = kv_cache_positions
        if kv_cache_positions is not None:  # the pools, together, stop growing at the budget
            engine.kv_page_limit = KVBudget(kv_cache_positions * sum(engine_bytes_per_position(engine)))
        self.page_size = engine.config.kv_page_size
        self.kv_shares = kv_shares(engine)  # sliding-window layers hold only their window's pages
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.max_prefill_tokens = max_prefill_tokens
        self.metrics = metrics
        # CPU intra-op threads for the scheduler thread. OpenMP settings are per calling thread, and a non-main
        # thread left at the default ran the default pair ~35% slower than with one thread (measured).
        self.threads = threads if threads is not None else (1 if engine.target.device.type == "cpu" else None)
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._cancels: set[str] = set()
        self._running: dict[str, Request] = {}  # scheduler thread only
        self._batch = engine.open_batch()
        self._accepting = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.num_running = 0  # rows in the batch after the last iteration (read by other threads)
        self.held_positions = 0  # cache positions the batch takes for its next cycle (read by other threads)
        self.cycles = 0

    # ---- any thread -------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="flashdraft-scheduler", daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def submit(self, prompt: list[int], params: SamplingParams, rid: str,
               loop: asyncio.AbstractEventLoop | None = None, priority: int = 0) -> Request:
        """Queue a request; its events arrive on `request.queue` (in `loop`). Raises QueueFull / SchedulerClosed /
        TooLarge (its cache alone exceeds the memory budget) / NotPrioritized (a priority under "fcfs")."""
        if priority and self.policy != "priority":
            raise NotPrioritized(f"priority {priority} needs priority scheduling (the server's --scheduling-policy "
                                 "priority); this one serves first come first served")
        loop = loop or asyncio.get_running_loop()
        req = Request(rid, list(prompt), params, loop, priority=priority)
        self._check_fits_alone(req)
        with self._cond:
            if not self._accepting or not self.alive:
                raise SchedulerClosed("the server is shutting down")
            # a request may skip the queue only if a batch slot is free for it right now
            free_slots = self.max_batch_size - self.num_running
            if len(self._waiting) >= self.max_queue + max(0, free_slots):
                raise QueueFull(f"the server is at capacity ({self.num_running} running, {len(self._waiting)} "
                                f"waiting, queue bound {self.max_queue}); retry later")
            self._enqueue(req)
            self._cond.notify()
        self._gauges()
        return req

    def _enqueue(self, req: Request) -> None:
        """Into the waiting queue, kept in order of (priority, arrival): first come first served where every
        priority is 0, and a preempted request (which arrived before everything waiting of its priority) goes ahead
        of those. Call with the lock held."""
        at = next((i for i, w in enumerate(self._waiting) if w.order > req.order), len(self._waiting))
        self._waiting.insert(at, req)

    @staticmethod
    def most_tokens(req: Request) -> int:
        """Tokens the request's row may ever hold: its prompt and max_tokens."""
        return len(req.prompt) + req.params.max_new_tokens

    def positions(self, row_tokens: list[int], prefilling: list[int] = ()) -> int:
        """Cache positions a batch of rows holding these many tokens takes for its next cycle (`held_positions`),
        with rows `prefilling` these many tokens: they hold every position of them, sliding-window layers too,
        until their first cycle gives back what left the window."""
        held = held_positions(row_tokens, self.engine.scratch_slots, self.page_size, self.kv_shares)
        if not prefilling:
            return held
        both = self.page_size if row_tokens else 0  # the trash pages, counted once
        return held + held_positions(list(prefilling), self.engine.scratch_slots, self.page_size) - both

    def _check_fits_alone(self, req: Request) -> None:
        budget = self.kv_cache_positions
        most = self.most_tokens(req)
        if budget is None or max(self.positions([most]), self.positions([], [len(req.prompt)])) <= budget:
            return
        capacity = row_capacity(self.most_tokens(req), self.engine.scratch_slots, self.page_size)
        raise TooLarge(
            f"this request may need a KV cache of {capacity} positions ({len(req.prompt)} prompt tokens + "
            f"max_tokens {req.params.max_new_tokens} + a block of {self.engine.scratch_slots}, in pages of "
            f"{self.page_size}), more than the server's whole budget of {budget} positions (--kv-cache-memory); "
            "lower max_tokens or shorten the prompt")

    @staticmethod
    def _tokens_to_prefill(req: Request) -> int:
        """A new request's prompt, or a preempted one's prompt and output so far (recomputed)."""
        return req.preempted.n_cached if req.preempted is not None else len(req.prompt)

    def _prefill_work(self, req: Request) -> int:
        """Tokens a prefill of the request computes (`--max-prefill-tokens` counts these): a new request's prompt
        after what the prefix cache holds of it."""
        return self.engine.tokens_to_compute(req) if req.preempted is None else self._tokens_to_prefill(req)

    def _fits(self, admit: list[Request], candidate: Request) -> bool:
        """Whether the batch (running rows + those admitted this iteration + candidate) fits the budget with one
        page of growth for every row (no more than it may ever hold), so that a join is not undone at once by a
        preemption."""
        if self.kv_cache_positions is None:
            return True
        running = [min(row.n_cached + self.page_size, self.most_tokens(self._running[row.index]))
                   if row.index in self._running else row.n_cached for row in self._batch.rows]
        joining = [min(self._tokens_to_prefill(r) + self.page_size, self.most_tokens(r)) for r in (*admit, candidate)]
        return self.positions(running, joining) <= self.kv_cache_positions

    def _preempt_to_fit(self) -> None:
        """While the batch's next cycle would take more than the budget, the running request that arrived last
        (of the least urgent priority) leaves it (its cache freed, its state kept) for the head of the queue (of its
        priority); a lone row always fits."""
        if self.kv_cache_positions is None:
            return
        while (len(self._batch.rows) > 1
               and self.positions([row.n_cached for row in self._batch.rows]) > self.kv_cache_positions):
            req = max((self._running[row.index] for row in self._batch.rows if row.index in self._running),
                      key=lambda r: r.order)
            req.preempted = self.engine.preempt(self._batch, req.rid)
            del self._running[req.rid]
            with self._cond:
                self._enqueue(req)
            if self.metrics is not None:
                self.metrics.preemptions.inc()
            log.info("preempted request %s (%d tokens held) to stay within --kv-cache-memory; it resumes when the "
                     "cache has room again", req.rid, req.preempted.n_cached)

    def cancel(self, rid: str) -> None:
        """Drop a request (waiting or running); nothing more is delivered for it. Safe to call more than once."""
        with self._cond:
            for req in self._waiting:
                if req.rid == rid:
                    self._waiting.remove(req)
                    self._count_finish(req, "abort", 0)
                    break
            else:
                self._cancels.add(rid)
            self._cond.notify()
        self._gauges()

    def stop(self, drain_timeout: float = 0.0) -> None:
        """Refuse new requests, let in-flight ones finish for up to `drain_timeout` s, then cancel the rest (503)."""
        with self._cond:
            self._accepting = False
        deadline = time.monotonic() + drain_timeout
        while self.alive and (self._waiting or self.num_running) and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ---- the scheduler thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            while self._iteration():
                pass
        except Exception:  # pragma: no cover - a bug: fail everyone rather than hang them
            log.exception("scheduler loop crashed")
            self._fail_all(500, "internal error in the scheduler")

    def _iteration(self) -> bool:
        with self._cond:
            while not (self._waiting or self._cancels or self._batch.rows or self._stopping):
                self._cond.wait()
            if self._stopping:
                admit = []
            else:
                admit, budget = [], self.max_prefill_tokens
                free = self.max_batch_size - len(self._batch.rows)
                while (self._waiting and len(admit) < free
                       and (not admit or self._prefill_work(self._waiting[0]) <= budget)
                       and self._fits(admit, self._waiting[0])):
                    req = self._waiting.popleft()
                    budget -= self._prefill_work(req)
                    admit.append(req)
            cancels, self._cancels = self._cancels, set()
        if self._stopping:
            self._fail_all(503, "the server shut down before the request finished")
            return False
        for req in [r for r in admit if r.rid in cancels]:  # cancelled between the queue and the batch
            admit.remove(req)
            cancels.discard(req.rid)
            self._count_finish(req, "abort", 0)
        for rid in cancels:
            req = self._running.pop(rid, None)
            if req is not None:
                self.engine.cancel(self._batch, rid)
                self._count_finish(req, "abort", 0)
        resumed, new = [r for r in admit if r.preempted is not None], [r for r in admit if r.preempted is None]
        if resumed:
            self._resume(resumed)
        if new and not self.engine.rides_cycle(self._batch, new):  # prefilled apart now, first tokens out at once
            self._admit(new)
            new = []
        self.num_running = len(self._batch.rows) + len(new)  # admitted rows run from now
        self._preempt_to_fit()
        if self._batch.rows:
            self._step(new)
        self.num_running = len(self._batch.rows)
        self.held_positions = self.positions([row.n_cached for row in self._batch.rows])
        self._gauges()
        return True

    def _step(self, joining: list[Request]) -> None:
        """One cycle of the batch, with the requests `joining` taken into it (`SpecEngine.step`). If the engine
        refuses one of them (`SpecEngine.check`: a bad prompt), they are admitted apart (`_admit` answers the
        culprit) and the cycle runs without them."""
        if joining:
            try:
                self.engine.check([r.prompt for r in joining], [r.params for r in joining])
            except ValueError:
                self._admit(joining)
                joining = []
        self._running.update((r.rid, r) for r in joining)  # from here on a failure fails them too
        try:
            if joining:
                events = self.engine.step(self._batch, [r.prompt for r in joining], [r.params for r in joining],
                                          request_ids=[r.rid for r in joining])
                self._started(joining)
            else:
                events = self.engine.step(self._batch)
        except Exception:
            log.exception("engine step failed; failing the batch")
            self._fail_running(500, "internal error while generating")
            events = []
        self.cycles += 1
        self._deliver(events)

    def _resume(self, reqs: list[Request]) -> None:
        """Preempted requests back into the batch (their prompt and output prefilled again)."""
        try:
            self.engine.resume(self._batch, [r.preempted for r in reqs])
        except Exception:
            log.exception("resuming preempted requests failed")
            for r in reqs:
                self._count_finish(r, "error", 0)
                self._send(r, Failure(500, "internal error while resuming a preempted request"))
            return
        for r in reqs:
            r.preempted = None
            self._running[r.rid] = r

    def _admit(self, reqs: list[Request]) -> None:
        try:
            events = self.engine.add(self._batch, [r.prompt for r in reqs], [r.params for r in reqs],
                                     request_ids=[r.rid for r in reqs])
        except Exception as e:
            if len(reqs) > 1:  # find the culprit: admit one by one
                for r in reqs:
                    self._admit([r])
                return
            status = 400 if isinstance(e, ValueError) else 500
            if status == 500:
                log.exception("prefill failed")
            self._send(reqs[0], Failure(status, str(e) if status == 400 else "internal error during prefill"))
            return
        for r in reqs:
            self._running[r.rid] = r
        self._started(reqs)
        self._deliver(events)

    def _started(self, reqs: list[Request]) -> None:
        """Requests now in the batch: their prompt tokens counted, their rows' statistics attached."""
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(sum(len(r.prompt) for r in reqs))
        for row in self._batch.rows:
            req = self._running.get(row.index)
            if req is not None and req.stats is None:
                req.stats = row.stats

    def _deliver(self, events: list[StreamEvent]) -> None:
        now = time.perf_counter()
        for ev in events:
            req = self._running.get(ev.index)
            if req is None:
                continue
            if ev.result is not None:
                req.stats = ev.result.stats
            if req.first_token_at is None and ev.token_ids:
                req.first_token_at = now
                if self.metrics is not None:
                    self.metrics.ttft.observe(now - req.arrival)
                    if self.engine.prefix_cache is not None and req.stats is not None:
                        self.metrics.prefix_cache_queries.inc(len(req.prompt))
                        self.metrics.prefix_cache_hits.inc(req.stats.cached_tokens)
            if self.metrics is not None:
                self.metrics.generation_tokens.inc(len(ev.token_ids))
            self._count_cycles(req)
            if ev.finished:
                del self._running[ev.index]
                self._count_finish(req, ev.result.finish_reason, len(ev.result.token_ids))
            self._send(req, ev)

    def _count_cycles(self, req: Request) -> None:
        if self.metrics is None or req.stats is None:
            return
        stats = req.stats
        lookups = (stats.lookup_steps, stats.lookup_drafts, stats.lookup_accepted)
        if self.engine.block_size > 1:
            self.metrics.count_drafts(stats.acceptance_lengths[req.counted_cycles:],
                                      stats.verify_widths[req.counted_cycles:], self.engine.block_size,
                                      stats.plain_steps - req.counted_steps, stats.draft_lengths[req.counted_cycles:],
                                      stats.lookup_splices - req.counted_splices,
                                      tuple(n - c for n, c in zip(lookups, req.counted_lookups)))
        req.counted_cycles, req.counted_steps = len(stats.acceptance_lengths), stats.plain_steps
        req.counted_splices, req.counted_lookups = stats.lookup_splices, lookups

    def _count_finish(self, req: Request, reason: str, output_tokens: int) -> None:
        if self.metrics is not None:
            self.metrics.finished(reason, time.perf_counter() - req.arrival, req.first_token_at and
                                  (time.perf_counter() - req.first_token_at), output_tokens)

    def _send(self, req: Request, item) -> None:
        try:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, item)
        except RuntimeError:  # the client's event loop is gone
            pass

    def _fail_running(self, status: int, message: str) -> None:
        for req in self._running.values():
            self._count_finish(req, "error", 0)
            self._send(req, Failure(status, message))
        self._running.clear()
        self._batch = self.engine.open_batch()

    def _fail_all(self, status: int, message: str) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for req in waiting:
            self._count_finish(req, "abort", 0)
            self._send(req, Failure(status, message))
        self._fail_running(status, message)
        self.num_running = self.held_positions = 0
        self._gauges()

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.running.set(self.num_running)
            self.metrics.waiting.set(len(self._waiting))
            self.metrics.kv_reserved.set(self.held_positions)
            self.metrics.kv_budget.set(self.kv_cache_positions or 0)
