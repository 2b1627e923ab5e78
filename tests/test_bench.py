"""`flashdraft bench` end to end on tiny models (CPU, float64): every in-process method, server mode against live
local servers, the losslessness check (passes on greedy; a deliberately wrong method is reported), datasets,
Prometheus parsing and the hf-assisted draft-model trainer."""

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from flashdraft import SpecEngine
from flashdraft.bench.cli import build_parser, main, run_bench
from flashdraft.bench.datasets import DatasetUnavailable, Prompt, load_prompts
from flashdraft.bench.methods import EngineMethod, Method, RunOutput
from flashdraft.bench.metrics import from_counters
from flashdraft.bench.server import counter_delta, level_summary, parse_servers, parse_spec_metrics, poisson_arrivals

sys.path.insert(0, str(Path(__file__).parent))
from test_bench_server import MiniServer  # noqa: E402
from tiny import load_tokenizer, save_text_pair  # noqa: E402

torch.set_num_threads(1)
PROMPTS = ["def fibonacci(n):\n", "import os\n\ndef list_files(path):\n", "class Stack:\n    def __init__(self):\n",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny Qwen3 target with the project's tokenizer, a DFlash drafter and a tiny random AR assistant."""
    root = tmp_path_factory.mktemp("bench_pair")
    # sharper logits: fewer near-ties, outputs that repeat (prompt lookup gets matches)
    tok, cfg = save_text_pair(root, block_size=4, lm_head_scale=4.0)
    torch.manual_seed(2)
    acfg = Qwen3Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    Qwen3ForCausalLM(acfg).save_pretrained(root / "assistant")
    lines = [json.dumps({"prompt": p}) for p in PROMPTS[:3]]
    lines.append(json.dumps({"messages": [{"role": "user", "content": "Write a function that reverses a list."}]}))
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _args(pair, out, *extra):
    return ["--target", str(pair / "target"), "--draft", str(pair / "drafter"), "--assistant", str(pair / "assistant"),
            "--dataset", str(pair / "prompts.jsonl"), "--device", "cpu", "--dtype", "float64",
            "--max-new-tokens", "20", "--num-assistant-tokens", "3", "--prompt-lookup-num-tokens", "4",
            "--output-dir", str(out), "--no-progress", *extra]


def test_every_method_in_process(pair, tmp_path, capsys):
    out = tmp_path / "out"
    # the fixed block, so that our engine drafts every cycle as the peers do (the default policy may hold this random
    # pair at one-token steps, depending on the machine's timings: no drafts to count)
    code = main(_args(pair, out, "--strict", "--draft-policy", "fixed"))
    printed = capsys.readouterr().out
    assert code == 0, printed
    res = json.loads((out / "results.json").read_text())
    assert [m["name"] for m in res["methods"]] == ["ar", "dflash", "hf-dflash", "hf-assisted", "prompt-lookup"]
    ds = res["datasets"]["prompts"]
    assert ds["num_prompts"] == 4
    for name, s in ds["methods"].items():
        for key in ("tau", "acceptance_histogram", "per_position_acceptance", "tokens_per_second", "speedup",
                    "ttft_ms", "tpot_ms", "mismatches", "acceptance_rate", "output_tokens"):
            assert key in s, (name, key)
        assert s["tokens_per_second"] > 0 and s["ttft_ms"] > 0
        assert s["mismatches"] == 0, name
        assert len(s["prompts"]) == 4
    m = ds["methods"]
    assert m["ar"]["speedup"] == 1.0 and m["ar"]["tau"] is None
    assert len(m["dflash"]["acceptance_histogram"]) == 4 and len(m["dflash"]["per_position_acceptance"]) == 3
    assert len(m["hf-dflash"]["acceptance_histogram"]) == 4
    assert len(m["hf-assisted"]["acceptance_histogram"]) == 4  # 3 drafts + bonus
    assert len(m["prompt-lookup"]["acceptance_histogram"]) == 5
    for name in ("dflash", "hf-dflash", "hf-assisted"):  # every cycle drafts, so cycles = drafts; tau in [1, k+1]
        assert m[name]["num_drafts"] > 0 and 1.0 <= m[name]["tau"] <= len(m[name]["acceptance_histogram"])
        assert sum(m[name]["acceptance_histogram"]) == m[name]["num_drafts"]
    # tau per prompt as a distribution over the prompts that drafted
    for name in ("dflash", "hf-dflash"):
        taus = sorted(r["tau"] for r in m[name]["prompts"] if r["tau"] is not None)
        d = m[name]["tau_per_prompt"]
        assert d["prompts"] == len(taus) and d["min"] == round(taus[0], 3) and d["min"] <= d["p10"] <= d["median"]
        assert d["mean"] == pytest.approx(np.mean(taus), abs=1e-3)
    assert m["ar"]["tau_per_prompt"] is None
    # the same drafter: our engine and transformers' DFlash accept exactly the same drafts
    ours = [r["acceptance_lengths"] for r in m["dflash"]["prompts"]]
    theirs = [r["acceptance_lengths"] for r in m["hf-dflash"]["prompts"]]
    assert [x[:len(y)] for x, y in zip(ours, theirs)] == [y[:len(x)] for x, y in zip(ours, theirs)]
    assert res["losslessness"] == {**res["losslessness"], "checked": True, "passed": True}
    for png in ("acceptance_histogram.png", "per_position_acceptance.png", "speedup.png"):
        assert (out / png).stat().st_size > 1000
    assert (out / "results.md").read_text().startswith("| dataset | method |")
    assert "losslessness: PASS" in printed and "prompt-lookup" in printed


def test_tree_methods_side_by_side(pair, tmp_path):
    """The chain, the drafter's tree alone and the tree with the prompt-lookup branch, in one run: each equals plain
    decoding; the chain verifies its 3 drafts per cycle, the tree its 6 nodes, the mix those and its lookup branch."""
    out = tmp_path / "out"
    code = main(_args(pair, out, "--strict", "--methods", "dflash-chain,dflash-tree,dflash", "--tree-budget", "6",
                      "--lookup-ngram", "2", "--draft-policy", "fixed"))
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    assert [m["name"] for m in res["methods"]] == ["ar", "dflash-chain", "dflash-tree", "dflash"]
    m = res["datasets"]["prompts"]["methods"]
    assert all(m[name]["mismatches"] == 0 for name in m)
    assert m["dflash-chain"]["num_draft_tokens"] == 3 * m["dflash-chain"]["num_drafts"]
    assert m["dflash-tree"]["num_draft_tokens"] == 6 * m["dflash-tree"]["num_drafts"]
    assert m["dflash"]["num_draft_tokens"] > 6 * m["dflash"]["num_drafts"]  # lookup branches add nodes
    assert res["losslessness"]["passed"]


def test_the_drafters_chain_beside_the_spliced_one(pair, tmp_path):
    """`dflash-drafter` is the engine without the prompt-lookup splice, beside `dflash` (with a 1-token minimum,
    so this tiny pair's repeats splice): both equal plain decoding, and the results say which configuration ran."""
    out = tmp_path / "out"
    assert main(_args(pair, out, "--strict", "--methods", "dflash-drafter,dflash", "--lookup-splice", "1",
                      "--draft-policy", "fixed")) == 0
    res = json.loads((out / "results.json").read_text())
    assert [m["name"] for m in res["methods"]] == ["ar", "dflash-drafter", "dflash"]
    assert [m["engine"]["lookup_splice"] for m in res["methods"][1:]] == [0, 1]
    m = res["datasets"]["prompts"]["methods"]
    assert all(m[name]["mismatches"] == 0 for name in m)
    assert res["losslessness"]["passed"]


class WrongMethod(Method):
    """Plain decoding that flips one token of every other prompt: a lossless method with a bug."""

    name = "broken"

    def __init__(self, target, tokenizer):
        self.inner = EngineMethod("broken", target, None, tokenizer, __import__("flashdraft").SamplingParams())
        self.calls = 0

    def run(self, prompt_ids, max_new_tokens):
        out = self.inner.run(prompt_ids, max_new_tokens)
        self.calls += 1
        if self.calls % 2 == 0:
            out.token_ids[len(out.token_ids) // 2] += 1
        return RunOutput(out.token_ids, out.wall_time, out.ttft)


def test_mismatch_is_reported_loudly(pair, tmp_path):
    from flashdraft.loading import load_target

    target, tok = load_target(pair / "target", "cpu", "float64")
    args = build_parser().parse_args(_args(pair, tmp_path, "--methods", "ar,dflash", "--strict"))
    buf = io.StringIO()
    from rich.console import Console

    console = Console(file=buf, force_terminal=True, width=160)
    # run() is called once for warm-up, then once per prompt: calls 2 and 4 = prompts 0 and 2 come out wrong
    code = run_bench(args, extra_methods=[WrongMethod(target, tok)], console=console)
    text = buf.getvalue()
    assert code == 1
    assert "LOSSLESSNESS FAILURE: broken" in text and "\x1b[1;31m" in text  # bold red
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["losslessness"]["passed"] is False
    assert res["losslessness"]["mismatches"] == {"ar": 0, "dflash": 0, "broken": 2}
    assert res["datasets"]["prompts"]["methods"]["broken"]["mismatched_prompts"] == [0, 2]
    assert res["exit"]["lossless_failures"] == {"broken": 2}
    bad = [r for r in res["datasets"]["prompts"]["methods"]["broken"]["prompts"] if not r["identical_to_target"]]
    assert all("first_difference_at" in r for r in bad)
    # without --strict the mismatch is still reported, but the exit code is 0
    args.strict = False
    assert run_bench(args, extra_methods=[WrongMethod(target, tok)], console=Console(file=io.StringIO())) == 0


def _engine(pair, with_drafter):
    from flashdraft.loading import load_pair

    target, tok, drafter = load_pair(pair / "target", pair / "drafter" if with_drafter else None, "cpu", "float64")
    return SpecEngine(target, drafter, tok, draft_policy="fixed"), tok  # drafts in every level, whatever the timing


def test_server_mode_sweep_against_live_servers(pair, tmp_path, capsys):
    ar_engine, tok = _engine(pair, False)
    spec_engine, _ = _engine(pair, True)
    out = tmp_path / "srv"
    with MiniServer(ar_engine, tok, "tiny") as ar, MiniServer(spec_engine, tok, "tiny") as spec:
        code = main(["--server", f"ar={ar.url}", "--server", f"dflash={spec.url}/v1", "--concurrency", "1,3",
                     "--dataset", str(pair / "prompts.jsonl"), "--max-new-tokens", "16", "--output-dir", str(out),
                     "--no-progress", "--strict"])
        served = spec.counters["drafts"]
    printed = capsys.readouterr().out
    assert code == 0, printed
    res = json.loads((out / "results.json").read_text())
    assert res["mode"] == "server" and set(res["servers"]) == {"ar", "dflash"}
    for name, srv in res["servers"].items():
        assert srv["model"] == "tiny"
        assert [lv["concurrency"] for lv in srv["levels"]] == [1, 3]
        for lv in srv["levels"]:
            assert lv["num_requests"] == 4 and lv["errors"] == 0
            assert lv["output_tokens"] > 0 and lv["throughput_tok_s"] > 0 and lv["ttft_ms"] > 0
            assert lv["mismatches"] == 0 and lv["speedup"] is not None
            assert all(r["token_count"] == "usage" for r in lv["requests"])
    d1 = res["servers"]["dflash"]["levels"][0]
    assert d1["acceptance_source"] == "metrics" and d1["num_drafts"] > 0
    assert abs(d1["tau"] - (1 + d1["num_accepted_tokens"] / d1["num_drafts"])) < 1e-3
    assert 0 < d1["drafting_share"] <= 1  # of the rows' cycles, those that drafted (the rest: one-token steps)
    assert len(d1["per_position_acceptance"]) == 3 and sum(d1["acceptance_histogram"]) == d1["num_drafts"]
    total = sum(lv["num_drafts"] for lv in res["servers"]["dflash"]["levels"])
    assert 0 < total < served  # the warm-up request is not counted in any level
    ar1 = res["servers"]["ar"]["levels"][0]  # no spec counters: the per-response `flashdraft.tau` (plain decoding: 1)
    assert ar1["acceptance_source"] == "response" and ar1["tau"] == 1.0
    assert (out / "throughput_concurrency.png").stat().st_size > 1000
    assert (out / "acceptance_histogram.png").is_file()
    assert "dflash" in printed and "concurrency" in printed


def test_requests_can_arrive_as_a_poisson_process(pair, tmp_path):
    """`--request-rate`: request i is sent at its arrival time (a seeded Poisson process, the same for every server),
    so a level lasts at least until its last arrival; without it every request is sent at once."""
    arrivals = poisson_arrivals(2000, 40.0, seed=3)
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals == poisson_arrivals(2000, 40.0, seed=3)
    gaps = np.diff(arrivals)
    assert np.mean(gaps) == pytest.approx(1 / 40, rel=0.08) and np.std(gaps) == pytest.approx(1 / 40, rel=0.1)
    assert poisson_arrivals(5, None) is None and poisson_arrivals(5, 40.0, seed=4) != poisson_arrivals(5, 40.0, seed=3)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(5, 0.0)
    engine, tok = _engine(pair, True)
    out = tmp_path / "rate"
    with MiniServer(engine, tok, "tiny") as spec:
        code = main(["--server", f"dflash={spec.url}", "--concurrency", "2", "--request-rate", "4",
                     "--num-requests", "4", "--dataset", str(pair / "prompts.jsonl"), "--max-new-tokens", "4",
                     "--output-dir", str(out), "--no-progress", "--no-plots"])
    assert code == 0
    level = json.loads((out / "results.json").read_text())["servers"]["dflash"]["levels"][0]
    assert level["request_rate"] == 4.0 and level["errors"] == 0
    assert level["wall_s"] >= poisson_arrivals(4, 4.0, seed=0)[-1]  # the last request was sent at its arrival
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--server", "http://x:1", "--request-rate", "0"])


def test_server_mode_against_dflash_serve(pair, tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("prometheus_client")
    try:
        from flashdraft.serve import create_app
        from flashdraft.serve.app import ServeConfig
    except ImportError:
        pytest.skip("flashdraft.serve is not available")
    import socket
    import threading
    import time

    import uvicorn

    engine, _ = _engine(pair, True)
    app = create_app(engine, ServeConfig(model_name="tiny", max_batch_size=4))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.05)
        out = tmp_path / "serve"
        code = main(["--server", f"http://127.0.0.1:{port}", "--concurrency", "1,2", "--dataset",
                     str(pair / "prompts.jsonl"), "--num-prompts", "3", "--max-new-tokens", "12", "--output-dir",
                     str(out), "--no-progress", "--no-plots"])
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    levels = res["servers"]["server"]["levels"]
    assert [lv["errors"] for lv in levels] == [0, 0]
    lv = levels[0]
    assert lv["acceptance_source"] == "metrics" and lv["num_drafts"] > 0
    # the counters the server exported, consistently: block 4 drafts 3 tokens; tau = 1 + accepted / drafts
    assert lv["num_draft_tokens"] == 3 * lv["num_drafts"] and 0 <= lv["num_accepted_tokens"] <= lv["num_draft_tokens"]
    assert lv["tau"] == pytest.approx(1 + lv["num_accepted_tokens"] / lv["num_drafts"], abs=1e-4)
    assert sum(lv["acceptance_histogram"]) == lv["num_drafts"]
    assert levels[0]["output_tokens"] > 0
    if sys.platform == "linux":  # the process collector reads /proc: work per token beside wall time
        assert all(lv["server_cpu_s"] > 0 and lv["tok_per_cpu_s"] > 0 for lv in levels)


def test_prometheus_counters_and_histogram_from_positions():
    text = """# HELP vllm:spec_decode_num_drafts_total drafts
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 2.0
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 36.0
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 2.0
vllm:num_requests_running{model_name="m"} 0.0
"""
    after = parse_spec_metrics(text)
    assert after == {"drafts": 12.0, "draft_tokens": 36.0, "accepted": 15.0, "per_pos": {0: 8.0, 1: 5.0, 2: 2.0}}
    assert parse_spec_metrics("process_virtual_memory_bytes 3.0\n") is None
    s = from_counters(counter_delta(None, after))
    assert s["tau"] == pytest.approx(1 + 15 / 12, abs=1e-4) and s["acceptance_rate"] == pytest.approx(15 / 36, 1e-3)
    assert s["acceptance_histogram"] == [4, 3, 3, 2]  # 12 drafts: 4 with 0 accepted, 3 with 1, 3 with 2, 2 with 3
    assert sum((j) * c for j, c in enumerate(s["acceptance_histogram"])) == 15
    # plain `name value` lines (our server: prometheus_client without prefix) parse too
    assert parse_spec_metrics("spec_decode_num_drafts_total 3\nspec_decode_num_accepted_tokens 4\n") == \
        {"drafts": 3.0, "accepted": 4.0}
    assert parse_servers(["ar=http://h:1/v1/", "http://x:2"]) == [("ar", "http://h:1"), ("server2", "http://x:2")]
    # our server also counts one-token steps: a level reports the share of the rows' cycles that drafted
    ours = parse_spec_metrics(text + "spec_decode_num_one_token_steps_total 40\n")
    before = {"drafts": 2.0, "one_token_steps": 4.0}
    assert counter_delta(before, ours)["one_token_steps"] == 36.0
    assert level_summary(4, [], 1.0, counter_delta(before, ours))["drafting_share"] == pytest.approx(10 / 46, 1e-3)
    assert level_summary(4, [], 1.0, {"drafts": 0.0, "one_token_steps": 9.0})["drafting_share"] == 0.0
    assert "drafting_share" not in level_summary(4, [], 1.0, None)
    # lookup steps are cycles the policy left without a draft: in the share's denominator, and reported
    ours = parse_spec_metrics(text + "spec_decode_num_one_token_steps_total 40\nspec_decode_num_lookup_steps_total 8\n"
                              "spec_decode_num_lookup_accepted_tokens_total 30\n")
    level = level_summary(4, [], 1.0, counter_delta(before, ours))
    assert level["drafting_share"] == pytest.approx(10 / 54, 1e-3)
    assert level["lookup_steps"] == 8 and level["lookup_accepted"] == 30
    # the server's CPU seconds over the level (the process collector's counter): tokens per CPU-second
    cpu = parse_spec_metrics("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.5\n")
    assert cpu == {"cpu_s": 12.5}
    level = level_summary(4, [{"error": None, "tokens": 40, "ttft_s": 0.1, "latency_s": 1.0}], 2.0,
                          counter_delta({"cpu_s": 10.5}, cpu))
    assert level["server_cpu_s"] == 2.0 and level["tok_per_cpu_s"] == 20.0 and level["throughput_tok_s"] == 20.0
    assert "server_cpu_s" not in level_summary(4, [], 1.0, counter_delta(before, ours))


def test_datasets_local_cached_and_offline(pair, tmp_path, monkeypatch):
    ps = load_prompts(str(pair / "prompts.jsonl"))
    assert ps[0] == Prompt(text=PROMPTS[0]) and ps[3].messages[0]["role"] == "user"
    tok = load_tokenizer()
    tok.chat_template = None  # a tokenizer without a template: messages fall back to "role: content" lines
    assert ps[3].encode(tok, chat=False)[:2] == tok("user: Write", add_special_tokens=False)["input_ids"][:2]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DatasetUnavailable) as err:
        load_prompts("gsm8k", cache_dir=tmp_path)
    msg = str(err.value)
    assert "gsm8k" in msg and str(tmp_path / "gsm8k.jsonl") in msg and "--dataset path.jsonl" in msg
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps({"prompt": "1+1?"}) + "\n" + json.dumps({"prompt": "2+2?"}))
    assert [p.text for p in load_prompts("gsm8k", 1, cache_dir=tmp_path)] == ["1+1?"]
    assert main(["--dataset", "mbpp", "--cache-dir", str(tmp_path), "--target", str(pair / "target"),
                 "--output-dir", str(tmp_path / "o"), "--no-progress"]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="'prompt' string or a 'messages' list"):
        load_prompts(str(bad))


def test_train_assistant_on_regenerated_shards(pair, tmp_path):
    from flashdraft.bench.assistant import main as assistant_main

    regen = tmp_path / "regen"
    regen.mkdir()
    g = torch.Generator().manual_seed(0)
    sequences = []
    with open(regen / "shard-00000.jsonl", "w") as f:
        for i in range(40):
            prompt = torch.randint(2, 50, (5,), generator=g).tolist()
            sequences.append(prompt + (prompt * 4)[:17] + [0])
            f.write(json.dumps({"index": i, "prompt_ids": prompt, "response_ids": (prompt * 4)[:17] + [0]}) + "\n")
        f.write(json.dumps({"index": 40, "prompt_ids": [5], "response_ids": [], "finish_reason": "prompt_too_long"})
                + "\n")
    out = tmp_path / "assistant"
    code = assistant_main(["--data", str(regen), "--target", str(pair / "target"), "--output-dir", str(out),
                           "--hidden-size", "32", "--num-layers", "1", "--num-heads", "2", "--num-kv-heads", "1",
                           "--head-dim", "16", "--intermediate-size", "64", "--max-steps", "30", "--batch-size", "8",
                           "--lr", "1e-2"])
    assert code == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and model.config.vocab_size == 8192
    assert model.config.tie_word_embeddings
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 30 and summary["train_sequences"] == 39 and summary["heldout_sequences"] == 1

    def next_token_loss(m):  # every token after the first, as the trainer's default --loss-on all
        x = torch.tensor(sequences)
        with torch.no_grad():
            logits = m.float()(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).item()

    torch.manual_seed(0)  # the trainer's seed: the same initial weights it started from
    initial = next_token_loss(Qwen3ForCausalLM(model.config))
    assert abs(initial - 9.01) < 0.3  # ln(8192): an untrained model is near uniform
    trained = next_token_loss(model)
    # the loss fell, by far more than an untrained (or not updated) model could show: measured 8.99 -> 4.70
    assert trained < initial - 3.0, (initial, trained)
    # the reported loss averages all 30 steps (including the first, near `initial`), so it sits between the two
    assert trained < summary["final_loss"] < initial - 0.75, (initial, summary["final_loss"], trained)
    assert "hf-assisted" in (out / "README.md").read_text()
    # it plugs into the benchmark as the hf-assisted draft model
    args = _args(pair, tmp_path / "b", "--methods", "hf-assisted", "--num-prompts", "1")
    args[args.index("--assistant") + 1] = str(out)
    assert main(args + ["--no-plots"]) == 0


def test_sampling_skips_the_equality_check_and_parser_mounts(pair, tmp_path):
    import argparse

    out = tmp_path / "s"
    assert main(_args(pair, out, "--methods", "dflash,prompt-lookup", "--num-prompts", "2", "--temperature", "0.8",
                      "--no-plots", "--strict")) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["losslessness"]["checked"] is False and res["datasets"]["prompts"]["methods"]["dflash"]["mismatches"] \
        is None
    parser = argparse.ArgumentParser(prog="flashdraft")
    from flashdraft.bench.cli import add_bench_parser

    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--methods", "ar,dflash", "--concurrency", "1,8"])
    assert args.func is run_bench and args.methods == ["ar", "dflash"] and args.concurrency == [1, 8]
    assert main(_args(pair, tmp_path / "u", "--methods", "ar,medusa")) == 2


# z-lab's package cannot be installed beside ours (it pins transformers 5.15), so CI runs the `zlab` method's runner
# (`flashdraft/bench/zlab_runner.py`, unchanged) against this stand-in of the `dflash` API it calls: plain greedy or
# sampled decoding through the target, one token per "cycle". It checks the plumbing (loading, the line protocol,
# stop ids, seeds, timing fields, the process's end), not their algorithm; tests/test_zlab_roundtrip.py runs their
# real package where its side environment exists.
FAKE_DFLASH_MODEL = '''
import json, time, types
from pathlib import Path

import torch

_cuda_time = None  # the runner swaps in time.perf_counter on CPU, as for their real module


class DFlashDraftModel:
    @classmethod
    def from_pretrained(cls, path, attn_implementation=None, dtype=None):
        cfg = json.loads((Path(path) / "config.json").read_text())
        model = cls()
        model.block_size, model.dtype = cfg["block_size"], dtype
        model.mask_token_id = cfg["dflash_config"]["mask_token_id"]
        model.target_layer_ids = cfg["dflash_config"]["target_layer_ids"]
        return model

    def to(self, device):
        return self

    def eval(self):
        return self


class DFlash2DraftModel(DFlashDraftModel):
    pass


def dflash_generate(model, target, input_ids, max_new_tokens, stop_token_ids, temperature=0.0, top_p=1.0,
                    top_k=0, block_size=None, return_stats=False):
    start = _cuda_time()
    ids, first = input_ids, None
    for _ in range(max_new_tokens):
        logits = target(ids).logits[:, -1].double()
        if temperature > 0:
            token = torch.multinomial(torch.softmax(logits / temperature, -1), 1)
        else:
            token = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, token], dim=1)
        first = first or _cuda_time() - start
        if stop_token_ids and int(token) in stop_token_ids:
            break
    steps = ids.shape[1] - input_ids.shape[1]
    return types.SimpleNamespace(output_ids=ids, acceptance_lengths=[1] * (steps - 1), time_to_first_token=first)
'''


@pytest.fixture
def fake_zlab(tmp_path, monkeypatch):
    """Our python as the 'side environment', with the stand-in `dflash` package on its path."""
    package = tmp_path / "fake_zlab" / "dflash"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from dflash.model import DFlash2DraftModel, DFlashDraftModel\n")
    (package / "model.py").write_text(FAKE_DFLASH_MODEL)
    (package.parent / "dflash-0.1.0.dist-info").mkdir()
    (package.parent / "dflash-0.1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: dflash\n"
                                                                       "Version: 0.1.0\n")
    monkeypatch.setenv("PYTHONPATH", str(package.parent))
    return sys.executable


def test_zlab_method_runs_their_generate_in_its_own_process(pair, fake_zlab):
    from flashdraft.bench.reference import target_greedy_generate
    from flashdraft.bench.zlab import ZlabMethod, zlab_python
    from flashdraft.engine import SamplingParams

    assert zlab_python("/nonexistent/python") is None and zlab_python(fake_zlab) == Path(fake_zlab)
    tok = load_tokenizer()
    target = AutoModelForCausalLM.from_pretrained(pair / "target", dtype=torch.float64).eval()
    prompt = tok.encode(PROMPTS[1])
    greedy = SamplingParams(max_new_tokens=12, stop_token_ids=(tok.eos_token_id,))
    method = ZlabMethod(fake_zlab, str(pair / "target"), str(pair / "drafter"), greedy, "float64", threads=1)
    try:
        assert method.max_draft == 3 and method.describe()["zlab"]["dflash_version"] == "0.1.0"
        out = method.run(prompt, 12)
        assert out.token_ids == target_greedy_generate(target, prompt, greedy)
        assert out.wall_time > 0 and 0 < out.ttft <= out.wall_time
        assert out.acceptance_lengths == [1] * (len(out.token_ids) - 1) and out.drafted == [3] * (len(out.token_ids) - 1)
    finally:
        method.close()
    assert method.runner.proc.poll() == 0  # the runner ended on "quit"
    # sampling: seeded in their process before every prompt, so a run repeats; another seed gives another text
    runs = {}
    for seed in (5, 5, 6):
        sampled = SamplingParams(max_new_tokens=24, temperature=1.0, seed=seed, stop_token_ids=())
        method = ZlabMethod(fake_zlab, str(pair / "target"), str(pair / "drafter"), sampled, "float64", threads=1)
        try:
            runs.setdefault(seed, []).append(method.run(prompt, 24).token_ids)
        finally:
            method.close()
    assert runs[5][0] == runs[5][1] and runs[5][0] != runs[6][0] and len(runs[6][0]) == 24  # stop ids () never stop


def test_bench_runs_the_peer_beside_ours(pair, tmp_path, fake_zlab):
    out = tmp_path / "out"
    code = main(_args(pair, out, "--methods", "dflash,zlab", "--zlab-python", fake_zlab, "--strict", "--no-plots"))
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    assert [m["name"] for m in res["methods"]] == ["ar", "dflash", "zlab"] and res["losslessness"]["passed"]
    m = res["datasets"]["prompts"]["methods"]
    assert m["zlab"]["mismatches"] == 0 and m["zlab"]["tau"] == 1.0
    assert m["zlab"]["tau_per_prompt"] == {"min": 1.0, "p10": 1.0, "median": 1.0, "mean": 1.0, "prompts": 4}
    # without a side environment the peer is skipped with a note, and the rest runs
    code = main(_args(pair, tmp_path / "none", "--methods", "zlab", "--zlab-python", str(tmp_path / "no-python"),
                      "--no-plots"))
    res = json.loads((tmp_path / "none" / "results.json").read_text())
    assert code == 0 and [m["name"] for m in res["methods"]] == ["ar"]
    assert any(n.startswith("zlab skipped: no side environment") for n in res["notes"])


def test_a_dflash2_drafter_meets_their_dflash2_class_and_transformers_is_skipped(pair, tmp_path, fake_zlab):
    """A DFlash2 checkpoint is loaded by their package's DFlash2 class (their DFlash-1 class would drop its
    convolutions and selector); transformers' DFlash, which reads DFlash-1 only, is skipped with a note, and so is
    their loop for convolutions longer than their two taps (it fails on a block shorter than the kernel)."""
    from flashdraft.bench.zlab import ZlabMethod
    from flashdraft.engine import SamplingParams
    from flashdraft.model.dflash2 import DFlash2DraftModel, make_dflash2_config

    tok = load_tokenizer()
    config = Qwen3Config.from_pretrained(pair / "target")
    for kernel in (2, 3):
        torch.manual_seed(0)
        DFlash2DraftModel(make_dflash2_config(config, num_layers=1, block_size=4, mask_token_id=tok.mask_token_id,
                                              conv_kernel_size=kernel, conv_group_size=8)
                          ).save_pretrained(tmp_path / f"d2_k{kernel}")
    greedy = SamplingParams(max_new_tokens=4)
    for drafter, cls in ((tmp_path / "d2_k2", "DFlash2DraftModel"), (pair / "drafter", "DFlashDraftModel")):
        method = ZlabMethod(fake_zlab, str(pair / "target"), str(drafter), greedy, "float64", threads=1)
        try:
            assert method.describe()["zlab"]["draft_class"] == cls
        finally:
            method.close()
    for kernel, ran in ((2, ["ar", "dflash", "zlab"]), (3, ["ar", "dflash"])):
        out = tmp_path / f"out_k{kernel}"
        args = _args(pair, out, "--methods", "dflash,hf-dflash,zlab", "--zlab-python", fake_zlab, "--num-prompts",
                     "1", "--max-new-tokens", "4", "--no-plots")
        args[args.index("--draft") + 1] = str(tmp_path / f"d2_k{kernel}")
        assert main(args) == 0
        res = json.loads((out / "results.json").read_text())
        assert [m["name"] for m in res["methods"]] == ran and res["losslessness"]["passed"]
        notes = " | ".join(res["notes"])
        assert "hf-dflash skipped: transformers' DFlash cannot run this drafter: DFlash2's" in notes
        assert ("zlab skipped: z-lab's dflash_generate stops with an error on DFlash2 drafters whose "
                "conv_kernel_size (3) exceeds 2" in notes) == (kernel == 3)


def test_a_side_environment_without_their_package_is_a_one_line_error(pair, tmp_path, capsys):
    code = main(_args(pair, tmp_path / "out", "--methods", "zlab", "--zlab-python", sys.executable, "--no-plots"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("flashdraft bench: error: ")
    assert "No module named 'dflash'" in err[0] and "setup_zlab_env.sh" in err[0]
