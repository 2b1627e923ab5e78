"""Run `flashdraft train` and hard-exit once N steps are done: a simulated kill, for the resume tests.

    python tests/killed_train.py N <flashdraft train arguments...>

Runs `flashdraft.train.cli`'s own entry point with `Trainer.train_step` patched to `os._exit(75)` when called with
N steps done (`self.step == N`), i.e. after step N's checkpoint and evaluation and before step N + 1 starts: no
cleanup, no export, nothing flushed beyond that point. Exits 75 if the kill happened, else as the CLI does.
"""

import os
import sys
from pathlib import Path

KILLED = 75


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        raise SystemExit(__doc__)
    kill_at = int(argv[0])
    try:
        import flashdraft  # noqa: F401
    except ImportError:  # not installed: run from the checkout, like `python -m` from the repository root
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from flashdraft.train import cli
    from flashdraft.train.trainer import Trainer

    train_step = Trainer.train_step

    def killed_train_step(self, step):
        if self.step == kill_at:
            os._exit(KILLED)
        return train_step(self, step)

    Trainer.train_step = killed_train_step
    return cli.main(["train", *argv[1:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
