#!/usr/bin/env bash
# The test command: sets up ./.venv (CPU torch 2.13 + flashdraft with all its extras) and runs the suite.
# Test files run in parallel (pytest-xdist, one worker per CPU; FLASHDRAFT_TEST_WORKERS=0 runs them in this process):
# each file stays on one worker (--dist loadfile), so its module fixtures are built once. The tests run torch on
# one thread (tests/conftest.py), so on a 2-core machine two workers take about half the time of one.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FLASHDRAFT_EXTRAS="${FLASHDRAFT_EXTRAS:-dev,train,serve,bench}" source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
set +e
"$PY" -m pytest -q -p no:cacheprovider -n "${FLASHDRAFT_TEST_WORKERS:-auto}" --dist loadfile tests "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "run_tests: pytest collected no tests - treating as a failure" >&2
fi
exit "$status"
