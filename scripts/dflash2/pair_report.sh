#!/usr/bin/env bash
# What issue 16 asks beside tau, for a finished `same_budget_pair.sh` run: the draft step of the two drafters
# (eager and compiled, calls interleaved) and the demo end to end with each (batch 1, T = 0 twice alternating, once
# compiled, T = 1 once; the shipped drafter once beside them), into $OUT/report/. WAIT=1 waits for the pair's
# comparison (compare_T1.md) first.
# Env: PY, OUT (default runs/same_budget_4000), WAIT (default 0), THREADS (default 1).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PY:-python}"
OUT="${OUT:-runs/same_budget_4000}"
THREADS="${THREADS:-1}"
REPORT="$OUT/report"
D1="$OUT/d1/final"
D2="$OUT/d2/final"
if [ "${WAIT:-0}" = 1 ]; then
    until [ -f "$OUT/compare_T1.md" ]; do sleep 60; done
fi
for d in "$D1" "$D2"; do
    [ -f "$d/config.json" ] || { echo "pair_report: $d/config.json is missing (train the pair first)" >&2; exit 2; }
done
mkdir -p "$REPORT"

echo "== draft step, DFlash2 / DFlash-1 (eager, compiled)"
for mode in eager compiled; do
    flag=()
    [ "$mode" = compiled ] && flag=(--compile)
    "$PY" scripts/dflash2/profile_draft.py --threads "$THREADS" --iters 300 --rounds 3 "${flag[@]}" \
        --dflash1 "$D1" --dflash2 "$D2" --json "$REPORT/draft_step_$mode.json" | tail -3
done

echo "== demo, batch 1 (each run with its own plain decoding)"
demo() {  # demo LABEL DRAFTER [flags...]
    local label="$1" drafter="$2"; shift 2
    echo "-- $label"
    "$PY" -m flashdraft.cli demo --threads "$THREADS" --draft "$drafter" --json "$REPORT/demo_$label.json" "$@" \
        > "$REPORT/demo_$label.txt" || echo "demo $label exited $?"
    grep -E "^tau|speedup|^losslessness" "$REPORT/demo_$label.txt"
}
for run in 1 2; do
    demo "d1_T0_$run" "$D1"
    demo "d2_T0_$run" "$D2"
done
demo shipped_T0 flashdraft/assets/default_pair/drafter
demo d1_T0_compiled "$D1" --compile
demo d2_T0_compiled "$D2" --compile
demo d1_T1 "$D1" --temperature 1
demo d2_T1 "$D2" --temperature 1
echo "wrote $REPORT"
