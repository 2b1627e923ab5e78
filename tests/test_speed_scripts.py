"""The speed scripts kept in the repo still run (scaled down): the GPU shape benchmark and the side-by-side bench."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "speed"))

import bench_speed  # noqa: E402
import gpu_shapes  # noqa: E402

from flashdraft.engine.proposers import DFlashProposer  # noqa: E402
from flashdraft.engine.target_kv import PagedTargetKV  # noqa: E402


def test_gpu_shapes_smoke(tmp_path):
    out = tmp_path / "shapes.json"
    assert gpu_shapes.main(["--tiny", "--device", "cpu", "--batch-sizes", "1,2", "--iters", "2", "--context", "48",
                            "--modes", "eager", "--tau", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 2] and report["tau"] == 4
    for r in report["rows"]:
        # tiny CPU steps: each takes well over a microsecond and well under a second
        for key in ("ar_ms", "verify_ms", "draft_ms"):
            assert 1e-3 < r[key] < 1e3, (key, r)


def test_timed_ms_measures_the_median_after_warm_up():
    calls = []

    def sleeper():
        calls.append(None)
        # three slow warm-up runs that must not count, then one slow outlier the median ignores (a mean would not)
        time.sleep(0.05 if len(calls) <= 3 else 0.15 if len(calls) == 4 else 0.005)

    ms = gpu_shapes.timed_ms(sleeper, 5, torch.device("cpu"))
    assert len(calls) == 3 + 5
    assert 5.0 <= ms < 25.0  # median 5 ms; the mean of the timed runs would be 34 ms


def test_gpu_shapes_projection_from_known_step_times(tmp_path, monkeypatch, capsys):
    """Known step times in, hand-computed cycle cost and projected speedup out (tau * AR / (verify + draft))."""
    known = {1: {"ar": 2.0, "verify": 3.0, "draft": 1.0},   # cycle 4 ms = 2.0 AR steps -> 6 / 2.0 = 3.0x
             2: {"ar": 4.0, "verify": 9.0, "draft": 7.0}}   # cycle 16 ms = 4.0 AR steps -> 6 / 4.0 = 1.5x
    seen = []
    real_verify, real_propose = PagedTargetKV.forward_block, DFlashProposer.propose

    def verify(self, block, positions, capture, end):
        seen.append(("ar" if block.shape[1] == 1 else "verify", block.shape[0]))
        return real_verify(self, block, positions, capture, end)

    def propose(self, state, inp, block_size):
        seen.append(("draft", inp.bonus.shape[0]))
        return real_propose(self, state, inp, block_size)

    def fake_timed_ms(fn, iters, device):
        seen.clear()
        fn()  # runs the real step once, which tells which step and batch size this is
        (step, batch), = set(seen)
        return known[batch][step]

    monkeypatch.setattr(PagedTargetKV, "forward_block", verify)
    monkeypatch.setattr(DFlashProposer, "propose", propose)
    monkeypatch.setattr(gpu_shapes, "timed_ms", fake_timed_ms)
    out = tmp_path / "shapes.json"
    assert gpu_shapes.main(["--tiny", "--device", "cpu", "--batch-sizes", "1,2", "--iters", "1", "--context", "48",
                            "--modes", "eager", "--tau", "6", "--json", str(out)]) == 0
    rows = {r["batch"]: r for r in json.loads(out.read_text())["rows"]}
    assert (rows[1]["ar_ms"], rows[1]["verify_ms"], rows[1]["draft_ms"]) == (2.0, 3.0, 1.0)
    assert rows[1]["cycle_over_ar"] == pytest.approx(2.0) and rows[1]["projected_speedup"] == pytest.approx(3.0)
    assert rows[2]["cycle_over_ar"] == pytest.approx(4.0) and rows[2]["projected_speedup"] == pytest.approx(1.5)
    table = capsys.readouterr().out
    assert "| eager | 1 | 2.00 | 3.00 | 1.00 | 2.00 | 3.00x |" in table
    assert "| eager | 2 | 4.00 | 9.00 | 7.00 | 4.00 | 1.50x |" in table


@pytest.mark.parametrize("drafter", ["default", "dflash2"])
def test_bench_speed_smoke(tmp_path, drafter):
    """Every method (ours, plain, transformers generate, and transformers' DFlash where it can run the drafter: the
    default DFlash-1 one, not the shipped DFlash2 one) gives the same greedy tokens; ours drafts every cycle
    (`--draft-policy fixed`: whether the adaptive policy drafts on two short prompts is the machine's timing)."""
    from flashdraft.loading import DFLASH2_DRAFTER

    out = tmp_path / "speed.json"
    draft = ["--draft", str(DFLASH2_DRAFTER)] if drafter == "dflash2" else []
    assert bench_speed.main(["--num-prompts", "2", "--max-new-tokens", "24", "--draft-policy", "fixed",
                             *draft, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["identical"].values()) == {2} and report["tau"] > 1
    assert ("transformers DFlash" in report["identical"]) == (drafter == "default")


def min_plain_runs_seen(monkeypatch) -> list[int]:
    """MIN_PLAIN_RUN as each new row of an adaptive policy saw it (a variant's constants are set while it runs)."""
    from flashdraft.engine import policy

    seen = []
    new_row = policy.AdaptiveWidth.new_row
    monkeypatch.setattr(policy.AdaptiveWidth, "new_row",
                        lambda self, sampled=False: seen.append(policy.MIN_PLAIN_RUN) or new_row(self, sampled))
    return seen


def test_engine_concurrency_smoke(tmp_path, capsys, monkeypatch):
    """The in-process load pattern on the shipped pair: every policy's cell is written; `never` never drafts
    (tau 1), `fixed` always does, with its first cycles' acceptance; a variant runs the default policy with the
    constants it names and leaves them as they were."""
    import engine_concurrency

    from flashdraft.engine import policy

    seen = min_plain_runs_seen(monkeypatch)
    out = tmp_path / "cells.json"
    assert engine_concurrency.main(["--concurrency", "2", "--sets", "held-out", "--num-prompts", "3",
                                    "--max-tokens", "8", "--rounds", "1", "--policies", "adaptive,fixed,never",
                                    "--variant", "slow:MIN_PLAIN_RUN=9,SMOOTHING=0.5", "--warm-full",
                                    "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    cell = report["cells"][0]
    assert report["variants"] == {"slow": {"MIN_PLAIN_RUN": 9, "SMOOTHING": 0.5}}
    assert cell["set"] == "held-out" and cell["concurrency"] == 2 and cell["plain_tok_s"] > 0
    assert cell["never"]["tau"] == 1.0 and cell["fixed"]["tau"] > 1.0
    assert cell["fixed"]["first_cycles"][0] >= 1.0 and cell["never"]["first_cycles"] == [None] * 4
    assert all(cell[p]["ratio"] > 0 for p in ("adaptive", "fixed", "never", "slow"))
    assert sorted(set(seen)) == [4, 9] and seen.count(9) == seen.count(4)  # the variant's rows, as many as adaptive's
    assert policy.MIN_PLAIN_RUN == 4 and policy.SMOOTHING == 0.3
    assert "| held-out | 2 |" in capsys.readouterr().out
    for bad in (["--policies", "sometimes"], ["--variant", "x:NOT_A_CONSTANT=1"], ["--variant", "x:SMOOTHING=fast"],
                ["--variant", "fixed:SMOOTHING=0.1"], ["--variant", "x"], ["--variant", "x:new_policy=1"],
                ["--max-tokens", "9-3"], ["--max-tokens", "0"], ["--max-tokens", "many"]):
        with pytest.raises(SystemExit):
            engine_concurrency.main(bad)


def test_engine_concurrency_requests_of_their_own_lengths():
    """--max-tokens LO-HI: each request its own length in the range, the same for every engine and run."""
    import engine_concurrency

    lengths = engine_concurrency.request_lengths("32-96", 200)
    assert lengths == engine_concurrency.request_lengths("32-96", 200) and min(lengths) >= 32 and max(lengths) <= 96
    assert len(set(lengths)) > 30
    assert engine_concurrency.request_lengths("64", 5) == [64] * 5
    from flashdraft.loading import load_pair

    target, tokenizer, drafter = load_pair(None, None, "cpu")
    prompts = [tokenizer.encode(t) for t in ("def add(a, b):", "import os\n", "class Stack:")]
    finished = []
    engine = engine_concurrency.build_engine(target, tokenizer, None, None)
    engine_concurrency.serve(engine, prompts, 2, [5, 9, 3], 0.0, finished)
    assert sorted(len(r.token_ids) for r in finished) == [3, 5, 9]


def test_engine_concurrency_lockstep(tmp_path, capsys, monkeypatch):
    """--lockstep: the engines serve the queue at once, a step each in turn, a variant's constants set around each
    of its own steps only (as many of its rows see them as the default policy's see theirs) and restored after;
    each engine is timed by its own steps and serves every request, as it does alone."""
    import engine_concurrency

    from flashdraft.engine import policy

    seen = min_plain_runs_seen(monkeypatch)
    out = tmp_path / "cells.json"
    assert engine_concurrency.main(["--concurrency", "2", "--sets", "held-out", "--num-prompts", "3",
                                    "--max-tokens", "8", "--rounds", "1", "--policies", "adaptive,never",
                                    "--variant", "slow:MIN_PLAIN_RUN=9", "--lockstep", "--json", str(out)]) == 0
    cell = json.loads(out.read_text())["cells"][0]
    assert all(cell[p]["ratio"] > 0 for p in ("adaptive", "never", "slow")) and cell["never"]["tau"] == 1.0
    assert sorted(set(seen)) == [4, 9] and seen.count(9) == seen.count(4) and policy.MIN_PLAIN_RUN == 4
    assert "| held-out | 2 |" in capsys.readouterr().out

    from flashdraft.loading import load_pair

    target, tokenizer, drafter = load_pair(None, None, "cpu")
    prompts = [tokenizer.encode(t) for t in ("def add(a, b):", "import os\n", "class Stack:")]
    engines = {k: engine_concurrency.build_engine(target, tokenizer, drafter, k) for k in ("adaptive", "never")}
    together = engine_concurrency.serve_lockstep(engines, prompts, 2, 12, 0.0)
    for key, engine in engines.items():
        alone = engine_concurrency.serve(engine, prompts, 2, 12, 0.0)
        assert together[key].tokens == alone[0] == 3 * 12 and together[key].seconds > 0


def test_idle_overhead_smoke(tmp_path, capsys):
    import idle_overhead

    out_json = tmp_path / "idle.json"
    assert idle_overhead.main(["--batch", "1,2", "--num-prompts", "2", "--max-new-tokens", "4", "--rounds", "2",
                               "--json", str(out_json)]) == 0
    cells = json.loads(out_json.read_text())["cells"]
    assert [c["batch"] for c in cells] == [1, 2]
    for c in cells:  # both engines generated every token of both rounds
        assert c["plain"]["tokens"] == c["dflash"]["tokens"] == 2 * 2 * 4 and c["ratio"] > 0
    assert "batch 2, T = 1.0" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        idle_overhead.main(["--batch", "0"])


def test_prefix_cache_turns_smoke(tmp_path):
    """Conversations of the shipped pair: a later turn finds its earlier prompts and answers in the cache, and the
    answers are those of the engine without it."""
    import prefix_cache_turns

    out = tmp_path / "turns.json"
    assert prefix_cache_turns.main(["--conversations", "2", "--turns", "3", "--max-tokens", "40",
                                    "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["same"] == 2
    shares = [t["cached_share"] for t in result["turns"]]
    assert shares[0] == 0 and 0 < shares[1] < shares[2]


def test_sampling_cost_smoke(capsys):
    import sampling_cost

    assert sampling_cost.main(["--vocab", "64", "--shapes", "2x1,3x4", "--iters", "2"]) == 0
    out = capsys.readouterr().out
    assert "| 2x1 |" in out and "| 3x4 |" in out
    for bad in (["--shapes", "2by1"], ["--shapes", "0x1"], ["--vocab", "1"]):
        with pytest.raises(SystemExit):
            sampling_cost.main(bad)


def test_policy_trace_smoke(tmp_path):
    """The GPU policy trace runs on CPU (scaled down) and reports what the plan saw and chose."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "gpu"))
    import policy_trace

    out = tmp_path / "trace.json"
    assert policy_trace.main(["--device", "cpu", "--dtype", "float32", "--num-prompts", "2", "--max-new-tokens", "24",
                              "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["prompts"]) == 2 and all(p["same_tokens"] for p in report["prompts"])
    for p in report["prompts"]:  # every token came from a drafting cycle or a one-token step
        assert p["one_token_steps"] + p["cycles"] >= 1
    assert report["body_ms"] and report["profile_plain"]["cycles"] > 0


def test_cycle_ops_smoke(tmp_path):
    """The per-cycle operator count runs on CPU (scaled down): plain decoding's step issues about the same operators
    whatever the rows, a fixed block's cycle more than a plain step (the draft and its context write)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "gpu"))
    import cycle_ops

    out = tmp_path / "ops.json"
    assert cycle_ops.main(["--device", "cpu", "--rows", "1,2", "--cycles", "2", "--engines", "plain,fixed",
                           "--json", str(out)]) == 0
    cells = {(c["engine"], c["rows"]): c for c in json.loads(out.read_text())["cells"]}
    assert set(cells) == {("plain", 1), ("plain", 2), ("fixed", 1), ("fixed", 2)}
    assert all(c["cycles"] == 2 and c["ms_per_cycle"] > 0 for c in cells.values())
    assert abs(cells["plain", 1]["aten_ops"] - cells["plain", 2]["aten_ops"]) <= 0.02 * cells["plain", 1]["aten_ops"]
    assert cells["fixed", 1]["aten_ops"] > cells["plain", 1]["aten_ops"]


def test_greedy_readout_script_smoke(tmp_path, capsys):
    """The read-out script, sampled: forward timings at one-token steps and 16-token verifies, then one cell whose
    screened engines' seeded outputs equal their full twins' (exit 0 only then)."""
    import greedy_readout

    out = tmp_path / "readout.json"
    assert greedy_readout.main(["--batch", "8", "--sets", "default", "--num-prompts", "8", "--max-new-tokens", "8",
                                "--rounds", "1", "--forward-reps", "1", "--temperature", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(v["rows"], v["width"]) for v in report["verify_forward"]] == [(8, 1), (8, 16)]
    assert report["cells"][0]["outputs_equal"]


def test_logprobs_cost_script_smoke(capsys):
    """Asking for log-probabilities changes no token (exit 0 only then), sampled rows included."""
    import logprobs_cost

    assert logprobs_cost.main(["--batch", "1,3", "--num-prompts", "3", "--max-tokens", "6", "--rounds", "1",
                               "--temperature", "1", "--top", "2"]) == 0
    assert capsys.readouterr().out.count("| True |") == 6


def test_grammar_compile_script_smoke(capsys):
    import grammar_compile

    assert grammar_compile.main(["--reps", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| json")]
    assert len(rows) == 3


def test_excluded_tokens_script_smoke(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "lossless"))
    import excluded_tokens

    out = tmp_path / "excluded.json"
    assert excluded_tokens.main(["--num-prompts", "2", "--max-new-tokens", "8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 and all(0 < r["tokens"] <= 16 and r["excluded"] == 0 for r in rows)


def test_lm_eval_check_writes_tasks_the_harness_reads(tmp_path):
    """The harness check's tasks (the harness itself lives in a side venv CI does not build): Jinja fields survive
    the YAML's formatting, each multiple-choice label points at the target's own continuation, and the generation
    target is that continuation up to a blank line."""
    import yaml

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "eval"))
    import lm_eval_check

    lm_eval_check.write_tasks(tmp_path, 4, 6)
    mc = yaml.safe_load((tmp_path / "flashdraft_code_mc.yaml").read_text())
    gen = yaml.safe_load((tmp_path / "flashdraft_code_gen.yaml").read_text())
    assert (mc["doc_to_text"], mc["doc_to_choice"], mc["doc_to_target"]) == ("{{context}}", "{{choices}}", "{{label}}")
    assert gen["doc_to_target"] == "{{continuation}}" and gen["generation_kwargs"]["max_gen_toks"] == 6
    assert gen["generation_kwargs"]["until"] == ["\n\n"] and Path(gen["dataset_kwargs"]["data_files"]["test"]).is_file()
    rows = [json.loads(line) for line in (tmp_path / "flashdraft_code_mc.jsonl").read_text().splitlines()]
    targets = [json.loads(line) for line in (tmp_path / "flashdraft_code_gen.jsonl").read_text().splitlines()]
    assert len(rows) == len(targets) == 4
    for row, target in zip(rows, targets):
        assert len(row["choices"]) == 4 and row["choices"][row["label"]].split("\n\n")[0] == target["continuation"]
