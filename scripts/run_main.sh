#!/usr/bin/env bash
# The main job: sets up ./.venv, then runs speculative generation on the shipped default pair for held-out
# prompts, next to plain decoding (tau, acceptance histogram, speedup, losslessness check).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$VENV/bin/flashdraft" demo "$@"
