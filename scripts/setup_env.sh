#!/usr/bin/env bash
# Creates ./.venv (once) and installs flashdraft into it. Sourced by run_main.sh and run_tests.sh.
# torch is pinned first to the CPU build so that the package's range resolves without pulling CUDA wheels.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FLASHDRAFT_VENV:-$ROOT/.venv}"
EXTRAS="${FLASHDRAFT_EXTRAS-}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q "torch>=2.6,<2.14"
fi
SPEC="$ROOT"
[ -n "$EXTRAS" ] && SPEC="$ROOT[$EXTRAS]"
"$PY" -m pip install -q -e "$SPEC"
export PY
