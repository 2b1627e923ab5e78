"""scripts/speed/serve_sweep.py's bookkeeping without servers: a cell's ratio is of throughputs summed over the
rounds, each round's own ratio, the mean tau and the mean share of drafting cycles are kept, and the table prints
the rounds' range and the shares."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("serve_sweep", ROOT / "scripts" / "speed" / "serve_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cell_keeps_each_rounds_ratio_and_the_mean_tau(sweep, monkeypatch, tmp_path):
    rounds = iter([  # (tokens, seconds, tau, share of drafting cycles, server CPU seconds) per server, by round
        {"dflash": (100, 1.0, 4.0, 0.5, 0.5), "ar": (100, 2.0, None, None, 1.0), "compare": (100, 4.0, 2.0, 0.0, None),
         "control": (100, 2.5, None, None, None)},
        {"dflash": (100, 2.0, 6.0, 0.25, 1.0), "ar": (100, 1.0, None, None, 1.0), "compare": (100, 1.0, 3.0, 0.0, None),
         "control": (100, 0.5, None, None, None)},
    ])

    def fake_run_servers(specs, prompts, levels, **kwargs):
        this = next(rounds)
        names = [s.split("=")[0] for s in specs]
        return {"servers": {n: {"levels": [{"errors": 0, "output_tokens": this[n][0], "wall_s": this[n][1],
                                            "tau": this[n][2], "mismatches": 0 if this[n][2] else None,
                                            "drafting_share": this[n][3], "server_cpu_s": this[n][4],
                                            "tok_per_cpu_s": this[n][4] and this[n][0] / this[n][4]}]}
                            for n in names}}

    monkeypatch.setattr(sweep, "run_servers", fake_run_servers)
    urls = {"dflash": "d", "ar": "a", "compare": "c", "control": "p"}
    out = sweep.cell(urls, ["p"], 4, 0.0, 8, 2)
    assert out["ratio"] == 1.0 and out["round_ratios"] == [2.0, 0.5]  # 200 / 3 s against 200 / 3 s
    assert out["tau"] == 5.0 and out["mismatches"] == 0 and out["drafting_share"] == 0.375
    assert out["compare_drafting_share"] == 0.0 and out["control_drafting_share"] is None
    assert out["compare_ratio"] == pytest.approx(0.6) and out["compare_round_ratios"] == [0.5, 1.0]
    assert out["compare_tau"] == 2.5 and out["ar_tok_s"] == pytest.approx(66.7)
    assert out["control_ratio"] == 1.0 and out["control_round_ratios"] == [0.8, 2.0] and out["control_tau"] is None
    # tokens per CPU-second of each server: 200 / 1.5 s against 200 / 2 s; servers without CPU time get none
    assert out["cpu_ratio"] == pytest.approx(1.333, abs=1e-3) and out["cpu_round_ratios"] == [2.0, 1.0]
    assert "compare_cpu_ratio" not in out and "control_cpu_ratio" not in out
    cells = [{"set": "held-out", "temperature": 0.0, "concurrency": 4, "busy_core": False, **out}]
    sweep.write_table(cells, [4], [0.0], ["held-out"], tmp_path)
    table = (tmp_path / "table.md").read_text()
    assert "| held-out | 0 | 1.00x (0.50-2.00) |" in table and "0.60x (0.50-1.00)" in table
    assert "noise floor" in table and "1.00x (0.80-2.00)" in table
    assert "| held-out | 0 | 38 % |" in table  # the drafting server's share of cycles that drafted
    assert "per CPU-second of each server" in table and "1.33x (1.00-2.00)" in table
    assert (tmp_path / "ratio.png").stat().st_size > 1000


def test_the_compare_server_can_run_from_another_checkout(sweep, monkeypatch, tmp_path):
    """`--compare-checkout DIR`: that server's `flashdraft serve` runs in DIR, so `-m` imports DIR's flashdraft."""
    import contextlib

    calls = []

    @contextlib.contextmanager
    def fake_local_server(args, log, name, cwd=None, cpus=None):
        calls.append((args, name, cwd))
        yield "http://127.0.0.1:1", None

    monkeypatch.setattr(sweep, "local_server", fake_local_server)
    with sweep.server("compare", ["--block-size", "8"], 1, 4, tmp_path, checkout=str(tmp_path / "before")) as url:
        assert url == "http://127.0.0.1:1"
    with sweep.server("dflash", [], 1, 4, tmp_path):
        pass
    assert calls[0][2] == str(tmp_path / "before") and calls[0][0][-2:] == ["--block-size", "8"]
    assert calls[1][2] is None


def test_prefix_cache_script_cells_send_new_requests_every_round_and_compare_their_texts(monkeypatch):
    """scripts/speed/prefix_cache.py's bookkeeping: each round's requests are new past the shared context, the
    ratios are of summed throughputs and mean first-token times, the cached share comes from the servers' counter
    deltas, and greedy texts are compared request by request."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts" / "speed"))
    spec = importlib.util.spec_from_file_location("prefix_cache_script", ROOT / "scripts" / "speed" / "prefix_cache.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from flashdraft.bench.datasets import Prompt

    sent, counters = [], {"c": [0.0, 0.0], "u": [0.0, 0.0]}

    def fake_run_servers(specs, prompts, levels, **kwargs):
        sent.append([p.text for p in prompts])
        assert kwargs["num_requests"] == len(prompts)
        out = {}
        for name, url in (s.split("=") for s in specs):
            cached = name == "cached"
            counters[url][0] += 100
            counters[url][1] += 80 if cached else 0
            reqs = [{"index": i, "ttft_s": 0.01 if cached else 0.04, "text": "x" if cached or i else "y"}
                    for i in range(len(prompts))]
            out[name] = {"levels": [{"errors": 0, "output_tokens": 64, "wall_s": 1.0 if cached else 2.0,
                                     "throughput_tok_s": 64 / (1.0 if cached else 2.0), "requests": reqs}]}
        return {"servers": out}

    monkeypatch.setattr(script, "run_servers", fake_run_servers)
    monkeypatch.setattr(script, "prefix_counters", lambda url: tuple(counters[url]))
    out = script.cell({"cached": "c", "uncached": "u"}, "CONTEXT\n", [Prompt(text="a"), Prompt(text="b")], 2, 0.0,
                      8, 2)
    assert all(t.startswith("CONTEXT\n# request 2.") for texts in sent for t in texts)
    assert len({t for texts in sent for t in texts}) == 4  # nothing past the context repeats
    assert out["throughput_ratio"] == 2.0 and out["ttft_ratio"] == 4.0
    assert out["cached"]["cached_share"] == 0.8 and out["uncached"]["cached_share"] == 0.0
    assert out["same_texts"] == 2  # request 0 of each round differs
