#!/usr/bin/env bash
# Side venv with EleutherAI's lm-evaluation-harness (PyPI `lm_eval`, `[api,hf]` extras) for
# scripts/eval/lm_eval_check.py: the harness scores a `flashdraft serve` endpoint (local-completions) and the same
# target through transformers (hf).
# Kept apart from our venv so that its pins never move ours. Outside the repository by default (FLASHDRAFT_LM_EVAL_VENV
# to move it).
set -euo pipefail
VENV="${FLASHDRAFT_LM_EVAL_VENV:-$HOME/.cache/flashdraft/venv-lmeval}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q "torch==2.13.0"          # the CPU build where the machine offers one (as for our venv)
"$PY" -m pip install -q "lm_eval[api,hf]>=0.4.8,<0.5"
"$PY" -c "import lm_eval, transformers; print('lm-eval side venv:', '$VENV', 'lm_eval', lm_eval.__version__,
'transformers', transformers.__version__)"
