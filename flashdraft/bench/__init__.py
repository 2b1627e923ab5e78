"""`flashdraft bench`: DFlash against plain decoding and other speculative methods, in process or against servers.

- `offline.run_offline(BenchConfig, target, tokenizer, drafter, assistant)`: methods interleaved prompt by prompt.
- `server.run_servers([url], prompts, [concurrency])`: OpenAI-compatible endpoints, concurrency sweep.
- `report`: console table, results JSON/Markdown, plots. `assistant`: trains the small AR draft for hf-assisted.
- `cli.add_bench_parser(subparsers)`: mounts the command; `python -m flashdraft.bench` runs it alone.
"""

from flashdraft.bench.datasets import DatasetUnavailable, Prompt, load_prompts
from flashdraft.bench.methods import ALL_METHODS, LOSSLESS_METHODS, Method, RunOutput
from flashdraft.bench.offline import BenchConfig, run_offline

__all__ = ["ALL_METHODS", "BenchConfig", "DatasetUnavailable", "LOSSLESS_METHODS", "Method", "Prompt", "RunOutput",
           "load_prompts", "run_offline"]
