#!/usr/bin/env bash
# Issue 16's comparison, one command: a DFlash-1 and a DFlash2 drafter for the shipped target trained on the same
# data with the same steps, then their tau side by side at T = 0 and T = 1, in and out of domain.
#   1. data      the mixture of BENCHMARKS.md 'DFlash2 against DFlash-1 at 2,000 steps' (12,750 answers of the
#                shipped target: 4,000 greedy to function starts, 4,750 greedy to coverage contexts, 4,000 sampled at
#                T = 1 with seed 0), regenerated where missing -> data/default_pair/regen_mixcov (links)
#   2. train     both from the shipped drafter (stage 8, `INIT`), same flags, same seed (so the same
#                batches), STEPS each; DFlash2 adds its convolutions and a selector over every token (rank 128,
#                its own lr, soft labels)
#   3. evaluate  scripts/drafter/eval_tau.py at T = 0 and T = 1 on each, pooled by scripts/dflash2/compare_tau.py
# Every step is skipped when its output exists, and training resumes from its newest checkpoint: a stopped run
# continues where it was. On the 2-core CPU: ~20 min of data, ~0.95 s (DFlash-1) and ~1.5 s (DFlash2) per step.
# Env: PY, STEPS (default 4000), OUT (default runs/same_budget_<STEPS>), NICE (default 10), ONLY (d1 or d2: one arm),
# CONV_KERNEL (DFlash2's convolution taps; default ours, 4; z-lab's package drafts only with 2: docs/checkpoints.md),
# D1 (a finished DFlash-1 arm's directory to compare with, e.g. another OUT's d1, when ONLY=d2),
# INIT (default flashdraft/assets/default_pair/drafter: the weights both arms start from),
# DEVICE (default cpu; cuda trains on a GPU: `STAGES=train_pair bash scripts/gpu/session_check.sh`), EVAL (default 1;
# 0 trains only, e.g. on a device machine whose checkpoints are evaluated here).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PY:-python}"
STEPS="${STEPS:-4000}"
DEVICE="${DEVICE:-cpu}"
OUT="${OUT:-runs/same_budget_$STEPS}"
RUNNER=(nice -n "${NICE:-10}")
TARGET=flashdraft/assets/default_pair/target
DATA=data/default_pair
MIX="$DATA/regen_mixcov"

echo "== [1/3] data -> $MIX"
if [ ! -f "$DATA/coverage_prompts.jsonl" ] || [ "$(wc -l < "$DATA/coverage_prompts.jsonl")" -lt 4750 ]; then
    "$PY" scripts/default_pair/prompts.py --train 4000 --heldout 64 --coverage 4750
fi
regen() {  # regen OUTPUT_DIR PROMPTS LIMIT SHARD [flags...]: skipped when the last shard is there
    local dir="$1" prompts="$2" limit="$3" shard="$4"; shift 4
    "${RUNNER[@]}" "$PY" -m flashdraft.cli regenerate --target "$TARGET" --data "$prompts" --limit "$limit" \
        --output-dir "$dir" --max-new-tokens 128 --batch-size 32 --shard-size "$shard" --device "$DEVICE" "$@"
}
regen "$DATA/regen_mix" "$DATA/train_prompts.jsonl" 4000 500
regen "$DATA/regen_cov" "$DATA/coverage_prompts.jsonl" 4750 250
regen "$DATA/regen_t1_s0" "$DATA/train_prompts.jsonl" 4000 500 --temperature 1.0 --seed 0
mkdir -p "$MIX"
for part in mix cov t1_s0; do
    for f in "$DATA/regen_$part"/shard-*.jsonl; do ln -sf "../regen_$part/$(basename "$f")" "$MIX/$part-$(basename "$f")"; done
done

COMMON=(--target "$TARGET" --data "$MIX" --init-from "${INIT:-flashdraft/assets/default_pair/drafter}" --block-size 16
        --num-draft-layers 2 --target-layer-ids 0,1,2,3 --max-steps "$STEPS" --batch-size 4 --max-length 2048
        --num-anchors 32 --start-anchors 8 --lr 1.5e-4 --seed 0 --distill-weight 1.0 --save-every 250 --device "$DEVICE")
D2=(--arch dflash2 --selector-top-k 8192 --selector-rank 128 --selector-lr 1.5e-3 --selector-distill-weight 1.0)
[ -n "${CONV_KERNEL:-}" ] && D2+=(--conv-kernel-size "$CONV_KERNEL")

for arm in d1 d2; do
    [ -n "${ONLY:-}" ] && [ "$ONLY" != "$arm" ] && continue
    run="$OUT/$arm"
    echo "== [2/3] train $arm -> $run ($STEPS steps)"
    if [ ! -f "$run/final/config.json" ]; then
        resume=()
        [ -d "$run/checkpoints" ] && resume=(--resume)
        extra=()
        [ "$arm" = d2 ] && extra=("${D2[@]}")
        "${RUNNER[@]}" "$PY" -m flashdraft.cli train "${COMMON[@]}" --output-dir "$run" "${extra[@]}" "${resume[@]}"
    fi
    [ "${EVAL:-1}" = 0 ] && continue
    echo "== [3/3] evaluate $arm"
    [ -f "$run/tau_T0/results.json" ] || "${RUNNER[@]}" "$PY" scripts/drafter/eval_tau.py --draft "$run/final" \
        --threads 2 --num 32 --label "$arm" --out "$run/tau_T0"
    [ -f "$run/tau_T1/results.json" ] || "${RUNNER[@]}" "$PY" scripts/drafter/eval_tau.py --draft "$run/final" \
        --threads 2 --num 32 --temperature 1 --lengths prompt,256,1024 --label "$arm" --out "$run/tau_T1"
done

D1="${D1:-$OUT/d1}"
if [ -f "$D1/tau_T0/results.json" ] && [ -f "$OUT/d2/tau_T0/results.json" ]; then
    for t in T0 T1; do
        echo "== T = ${t#T}: DFlash2 against DFlash-1, $STEPS steps each"
        "$PY" scripts/dflash2/compare_tau.py "DFlash-1=$D1/tau_$t/results.json" "DFlash2=$OUT/d2/tau_$t/results.json" \
            | tee "$OUT/compare_$t.md"
    done
fi
