"""(No tests here: a helper of test_bench.py.) A minimal OpenAI-compatible server for the bench tests (stdlib http.server, one thread per connection).

It serves real generations from a `SpecEngine` (one request at a time behind a lock), streams SSE chunks for
/v1/completions and /v1/chat/completions, lists its model at /v1/models and exposes the vLLM spec-decode counters
at /metrics (with vLLM's `vllm:` prefix, `_total` suffix and a `model_name` label, to exercise the parser).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from flashdraft import SamplingParams


class MiniServer:
    def __init__(self, engine, tokenizer, model_name="tiny"):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.lock = threading.Lock()
        self.counters = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": {}}
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def metrics_text(self):
        c, k = self.counters, self.engine.block_size - 1
        label = f'model_name="{self.model_name}"'
        lines = ["# TYPE vllm:spec_decode_num_drafts counter"]
        if k:
            lines += [f"vllm:spec_decode_num_drafts_total{{{label}}} {c['drafts']}",
                      f"vllm:spec_decode_num_draft_tokens_total{{{label}}} {c['draft_tokens']}",
                      f"vllm:spec_decode_num_accepted_tokens_total{{{label}}} {c['accepted']}"]
            lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{i}"}} '
                      f"{c['per_pos'].get(i, 0)}" for i in range(k)]
        return "\n".join(lines) + "\n"

    def generate_stream(self, prompt_ids, body):
        params = SamplingParams(max_new_tokens=int(body.get("max_tokens", 16)),
                                temperature=float(body.get("temperature", 0.0)),
                                stop_token_ids=() if body.get("ignore_eos") else (self.tokenizer.eos_token_id,))
        with self.lock:
            for event in self.engine.stream([prompt_ids], params):
                yield event

    def record(self, stats):
        k = self.engine.block_size - 1
        if not k:
            return
        c = self.counters
        c["drafts"] += stats.num_drafts
        c["draft_tokens"] += stats.num_drafts * k
        c["accepted"] += stats.num_accepted_tokens
        for i in range(k):
            c["per_pos"][i] = c["per_pos"].get(i, 0) + sum(a - 1 > i for a in stats.acceptance_lengths)

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _json(self, obj, status=200):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._json({"object": "list", "data": [{"id": server.model_name, "object": "model"}]})
                elif self.path == "/metrics":
                    data = server.metrics_text().encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self._json({"error": {"message": "not found"}}, 404)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                chat = self.path == "/v1/chat/completions"
                if self.path not in ("/v1/completions", "/v1/chat/completions") or not body.get("stream"):
                    return self._json({"error": {"message": "only streaming completions"}}, 400)
                tok = server.tokenizer
                if chat:
                    text = "\n".join(f"{m['role']}: {m['content']}" for m in body["messages"]) + "\nassistant: "
                else:
                    text = body["prompt"]
                ids = tok(text, add_special_tokens=False)["input_ids"] or [tok.eos_token_id]
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                result = None
                for event in server.generate_stream(ids, body):
                    if event.text:
                        choice = {"index": 0, "delta": {"content": event.text}} if chat else \
                            {"index": 0, "text": event.text}
                        self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                        self.wfile.flush()
                    if event.finished:
                        result = event.result
                server.record(result.stats)
                final = {"choices": [], "usage": {"prompt_tokens": len(ids),
                                                  "completion_tokens": len(result.token_ids)},
                         "dflash": {"tau": result.stats.tau}}
                self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
                self.wfile.flush()
                self.close_connection = True

        return Handler
