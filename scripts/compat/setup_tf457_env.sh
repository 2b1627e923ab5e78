#!/usr/bin/env bash
# Side venv with transformers 4.57 (the stack of z-lab's earlier hub checkpoints: AutoModel.from_pretrained(path,
# trust_remote_code=True) with a dflash.py beside the weights) for scripts/compat/zlab_roundtrip.py and
# tests/test_zlab_roundtrip.py. It cannot share our venv (we need transformers>=5.23). Outside the repository by
# default (FLASHDRAFT_TF457_VENV to move it).
set -euo pipefail
VENV="${FLASHDRAFT_TF457_VENV:-$HOME/.cache/flashdraft/venv-tf457}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q "torch==2.13.0"          # the CPU build where the machine offers one (as for our venv)
"$PY" -m pip install -q "transformers==4.57.*" safetensors
"$PY" -c "import transformers, torch; print('transformers-4.57 side venv:', '$VENV', 'transformers', transformers.__version__, 'torch', torch.__version__)"
