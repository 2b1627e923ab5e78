"""Prometheus metrics of the server, named as vLLM names them (without its `vllm:` prefix).

Speculative decoding (counted per verify cycle, live, as vLLM does):
  spec_decode_num_drafts                      cycles that verified a draft block
  spec_decode_num_draft_tokens                draft tokens the target verified (w - 1 in a cycle of width w)
  spec_decode_num_accepted_tokens             draft tokens the target accepted
  spec_decode_num_accepted_tokens_per_pos     accepted drafts by position in the block (label `position`, 0-based)
  => mean acceptance length tau = 1 + accepted_tokens / drafts; acceptance rate = accepted / draft_tokens.
  spec_decode_num_proposed_tokens             tokens the drafter proposed (per drafting cycle, the cycle's widest
                                              width - 1; the draft policy verifies a prefix of them)
  spec_decode_num_one_token_steps             cycles a request decoded one token without a draft (policy's choice)
Serving: num_requests_running / num_requests_waiting (gauges), prompt_tokens / generation_tokens (counters),
request_success{finished_reason} (stop, length, abort, error), requests_rejected{reason}, num_preemptions (running
requests preempted for the KV-cache budget), prefix_cache_queries / prefix_cache_hits (prompt tokens looked up in
the prefix cache and found there, counted at each request's first token), kv_cache_reserved_positions /
kv_cache_budget_positions, and histograms e2e_request_latency_seconds, time_to_first_token_seconds,
time_per_output_token_seconds. The process's own (prometheus_client's process collector, Linux):
process_cpu_seconds_total, process_resident_memory_bytes, ... (the CPU seconds a level of requests took are what
`flashdraft bench --server` divides its tokens by: work per token that another process on the machine does not
move, as wall time does).
prometheus_client appends `_total` to counter names in the exposition text (`spec_decode_num_drafts_total`).

Each server gets its own registry (several servers in one process, as in the tests, do not collide). Every
series carries `model_name`. With plain decoding (`--no-draft`) the spec-decode counters stay at zero.

What this module does not know about: the engine, requests, HTTP; callers report numbers to it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.model_name = model_name
        r, m = self.registry, ["model_name"]

        def counter(name, doc, labels=()):
            return Counter(name, doc, m + list(labels), registry=r)

        self._num_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts (verify cycles).")
        self._draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens proposed.")
        self._accepted = counter("spec_decode_num_accepted_tokens", "Number of draft tokens accepted.")
        self._proposed = counter("spec_decode_num_proposed_tokens", "Number of tokens the drafter proposed.")
        self._one_token_steps = counter("spec_decode_num_one_token_steps",
                                        "Decoding steps of one token without a draft (the draft policy's choice).")
        self._lookup_splices = counter("spec_decode_num_lookup_splices",
                                       "Drafting cycles whose chain prompt lookup continued (--lookup-splice).")
        self._lookup_steps = counter("spec_decode_num_lookup_steps", "One-token steps that verified a prompt-lookup "
                                     "continuation (--lookup-steps); not in the drafter's counters.")
        self._lookup_drafts = counter("spec_decode_num_lookup_draft_tokens",
                                      "Prompt-lookup tokens verified at one-token steps (--lookup-steps).")
        self._lookup_accepted = counter("spec_decode_num_lookup_accepted_tokens",
                                        "Prompt-lookup tokens accepted at one-token steps (--lookup-steps).")
        self._accepted_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted draft tokens by position in the block.", ["position"])
        self._prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self._generation_tokens = counter("generation_tokens", "Number of generated tokens.")
        self._success = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        self._rejected = counter("requests_rejected", "Requests refused before generation.", ["reason"])
        self._preemptions = counter("num_preemptions", "Running requests preempted to stay within the KV-cache "
                                    "budget (recomputed when they resume).")
        self._prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self._prefix_hits = counter("prefix_cache_hits", "Prompt tokens the prefix cache gave (not computed).")
        self._running = Gauge("num_requests_running", "Requests in the running batch.", m, registry=r)
        self._waiting = Gauge("num_requests_waiting", "Requests waiting for a batch slot.", m, registry=r)
        self._kv_reserved = Gauge("kv_cache_reserved_positions", "KV-cache positions the running batch takes for "
                                  "its next cycle (target and drafter; every row at the longest row's tokens plus "
                                  "a block, in chunks).", m, registry=r)
        self._kv_budget = Gauge("kv_cache_budget_positions", "KV-cache positions --kv-cache-memory allows "
                                "(0: no budget).", m, registry=r)
        self._e2e = Histogram("e2e_request_latency_seconds", "Request latency, arrival to last token.", m,
                              buckets=LATENCY_BUCKETS, registry=r)
        self._ttft = Histogram("time_to_first_token_seconds", "Arrival to first token.", m, buckets=TTFT_BUCKETS,
                               registry=r)
        self._tpot = Histogram("time_per_output_token_seconds", "Mean time per output token after the first.", m,
                               buckets=TPOT_BUCKETS, registry=r)
        self.prompt_tokens = self._prompt_tokens.labels(model_name)
        self.generation_tokens = self._generation_tokens.labels(model_name)
        self.running = self._running.labels(model_name)
        self.waiting = self._waiting.labels(model_name)
        self.kv_reserved = self._kv_reserved.labels(model_name)
        self.kv_budget = self._kv_budget.labels(model_name)
        self.preemptions = self._preemptions.labels(model_name)
        self.prefix_cache_queries = self._prefix_queries.labels(model_name)
        self.prefix_cache_hits = self._prefix_hits.labels(model_name)
        self.ttft = self._ttft.labels(model_name)
        self._block_size = 0
        for c in (self._num_drafts, self._draft_tokens, self._accepted, self._proposed, self._one_token_steps,
                  self._lookup_splices, self._lookup_steps, self._lookup_drafts, self._lookup_accepted):
            # present (at zero) from the start
            c.labels(model_name)

    def count_drafts(self, acceptance_lengths: list[int], verify_widths: list[int], block_size: int,
                     one_token_steps: int = 0, draft_lengths: list[int] | None = None, lookup_splices: int = 0,
                     lookups: tuple[int, int, int] = (0, 0, 0)) -> None:
        """Add verify cycles (acceptance length a: a - 1 drafts accepted, positions 0 .. a - 2; width w: w - 1
        drafts verified; draft length d: d - 1 drafts proposed, the whole block when not given), one-token
        steps, chains continued by prompt lookup and `lookups`: (one-token steps that verified a lookup
        continuation, its tokens verified, accepted)."""
        if one_token_steps:
            self._one_token_steps.labels(self.model_name).inc(one_token_steps)
        if lookup_splices:
            self._lookup_splices.labels(self.model_name).inc(lookup_splices)
        for counter, value in zip((self._lookup_steps, self._lookup_drafts, self._lookup_accepted), lookups):
            if value:
                counter.labels(self.model_name).inc(value)
        if not acceptance_lengths:
            return
        k = block_size - 1
        if block_size != self._block_size:  # expose every position, zeros included
            for pos in range(k):
                self._accepted_pos.labels(self.model_name, str(pos))
            self._block_size = block_size
        per_pos = [0] * k
        for a in acceptance_lengths:
            for pos in range(a - 1):
                per_pos[pos] += 1
        self._num_drafts.labels(self.model_name).inc(len(acceptance_lengths))
        self._draft_tokens.labels(self.model_name).inc(sum(w - 1 for w in verify_widths))
        proposed = k * len(acceptance_lengths) if draft_lengths is None else sum(d - 1 for d in draft_lengths)
        self._proposed.labels(self.model_name).inc(proposed)
        self._accepted.labels(self.model_name).inc(sum(per_pos))
        for pos, n in enumerate(per_pos):
            if n:
                self._accepted_pos.labels(self.model_name, str(pos)).inc(n)

    def finished(self, reason: str, latency: float, decode_time: float | None, output_tokens: int) -> None:
        self._success.labels(self.model_name, reason).inc()
        if reason in ("stop", "length"):
            self._e2e.labels(self.model_name).observe(latency)
            if decode_time is not None and output_tokens > 1:
                self._tpot.labels(self.model_name).observe(decode_time / (output_tokens - 1))

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
