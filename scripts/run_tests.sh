#!/usr/bin/env bash
# The test command: sets up ./.venv (CPU torch 2.13 + flashdraft with all its extras) and runs the suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FLASHDRAFT_EXTRAS="${FLASHDRAFT_EXTRAS:-dev,train,serve,bench}" source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
set +e
"$PY" -m pytest -q -p no:cacheprovider tests "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "run_tests: pytest collected no tests - treating as a failure" >&2
fi
exit "$status"
