#!/usr/bin/env bash
# Side venv with z-lab's own DFlash package (PyPI `dflash` 0.1.0, `[local]` extra: torch 2.13.0, transformers
# 5.15.0) for scripts/speed/bench_zlab.py. It cannot share our venv: `dflash[local]` pins transformers==5.15.0,
# flashdraft needs transformers>=5.23. Outside the repository by default (FLASHDRAFT_ZLAB_VENV to move it).
set -euo pipefail
VENV="${FLASHDRAFT_ZLAB_VENV:-$HOME/.cache/flashdraft/venv-zlab}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q "torch==2.13.0"          # the CPU build where the machine offers one (as for our venv)
"$PY" -m pip install -q "dflash[local]==0.1.0"
"$PY" -c "import dflash, transformers, torch; print('z-lab dflash side venv:', '$VENV', 'transformers', transformers.__version__, 'torch', torch.__version__)"
