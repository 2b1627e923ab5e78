"""z-lab's own `dflash` package as a benchmark method (`flashdraft bench --methods zlab`): the peer itself, not a
re-implementation of it, beside our engine on the same prompts, interleaved prompt by prompt.

Their package (PyPI `dflash` 0.1.0) pins transformers 5.15 (`dflash[local]`) and exact versions of datasets,
requests and tqdm, and ours needs transformers >= 5.23, so it runs in a side environment
(`scripts/speed/setup_zlab_env.sh`; found at --zlab-python, $FLASHDRAFT_ZLAB_PYTHON or
~/.cache/flashdraft/venv-zlab): a persistent subprocess (`zlab_runner.py`, run as a file, which imports nothing of
ours) loads the same target and drafter with their loader, in one dtype (their loop feeds the target's embeddings
and features to the drafter and its hidden states to the target's lm_head, so it cannot mix dtypes), and decodes
with their `dflash_generate` (their sampling at temperature > 0, seeded per prompt). Timing is theirs, around each
call (prefill included, as for every other method); acceptance lengths are theirs.

What this module does not know about: how their loop works (it only speaks the runner's line protocol).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from flashdraft.bench.methods import Method, RunOutput
from flashdraft.engine import SamplingParams

RUNNER = Path(__file__).resolve().parent / "zlab_runner.py"
DEFAULT_ZLAB_PYTHON = Path.home() / ".cache" / "flashdraft" / "venv-zlab" / "bin" / "python"


def zlab_python(path: str | None = None) -> Path | None:
    """The side environment's python: `path`, else $FLASHDRAFT_ZLAB_PYTHON, else the default venv; None if that
    file does not exist."""
    chosen = Path(path or os.environ.get("FLASHDRAFT_ZLAB_PYTHON") or DEFAULT_ZLAB_PYTHON)
    return chosen if chosen.is_file() else None


class ZlabUnavailable(ValueError):
    """The side environment could not start z-lab's runner (no `dflash` there, a broken venv, models it cannot load)."""


class ZlabRunner:
    """The side environment's `zlab_runner.py`, kept alive across prompts (models loaded once)."""

    def __init__(self, python: str | Path, target: str, draft: str, threads: int | None = None,
                 dtype: str = "float32", device: str = "cpu"):
        cmd = [str(python), str(RUNNER), "--target", str(target), "--draft", str(draft), "--dtype", dtype,
               "--device", device]
        if threads:
            cmd += ["--threads", str(threads)]
        # its log goes to a file (a pipe nobody reads would fill and stop it), whose last line explains a failed start
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        try:
            self.info = self._read()
        except (RuntimeError, json.JSONDecodeError) as exc:
            self.close()
            raise ZlabUnavailable(f"{python}: z-lab's runner did not start ({exc}); the side environment needs z-lab's "
                                  "`dflash` 0.1.0 (bash scripts/speed/setup_zlab_env.sh)") from None

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            err = ([t for t in self.log.read().splitlines() if t.strip()] or [""])[-1]
            raise RuntimeError(f"z-lab runner exited (rc {self.proc.wait()}): {err}")
        return json.loads(line)

    def request(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()
        self.log.close()


class ZlabMethod(Method):
    """`zlab`: their `dflash_generate`, batch 1, block = their drafter's."""

    name = "zlab"

    def __init__(self, python: str | Path, target: str, draft: str, params: SamplingParams, dtype: str = "float32",
                 threads: int | None = None, device: str = "cpu"):
        self.params = params
        self.runner = ZlabRunner(python, target, draft, threads, dtype, device=device)
        self.max_draft = int(self.runner.info["block_size"]) - 1

    def describe(self) -> dict:
        return {**super().describe(), "zlab": self.runner.info}

    def run(self, prompt_ids, max_new_tokens):
        p = self.params
        seed = None if p.greedy or p.seed is None else p.seed
        reply = self.runner.request(cmd="round", prompts=[list(prompt_ids)], max_new_tokens=max_new_tokens,
                                    block_size=None, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                    seed=seed, stop_token_ids=list(p.stop_token_ids))
        lengths = list(reply["acceptance_lengths"][0])
        return RunOutput(list(reply["outputs"][0]), reply["seconds"][0], reply["ttft"][0] or 0.0, lengths,
                         [self.max_draft] * len(lengths))

    def close(self) -> None:
        self.runner.close()
