#!/usr/bin/env bash
# Issue 17 with issue 16's architecture: the shipped DFlash2 drafter's run (runs/stage10_dflash2, or the 2-tap arm of
# same_budget_pair.sh) continued on more of the target's own answers, then evaluated beside the shipped one.
#   1. data      the 12,750 answers it was trained on (greedy to 4,000 function starts and 4,750 coverage contexts,
#                sampled at T = 1 to the function starts, seed 0) plus 5,750 more coverage contexts (prompts.py
#                --coverage 16000 cuts the same first 4,750; the first 10,500 are answered) and the function starts
#                sampled again with seed 1: 22,500 answers -> data/default_pair/regen_more (links)
#   2. train     from INIT (the fp32 run the shipped bf16 drafter was exported from), STEPS more steps at lr 1e-4,
#                seed 4, every answer's first blocks among the anchors; resumes from its newest checkpoint
#   3. evaluate  scripts/drafter/eval_tau.py at T = 0 and T = 1, pooled against the shipped DFlash2 drafter's
#                evaluation (docs/bench/default_dflash2/dflash2_tau_T*.json) by scripts/dflash2/compare_tau.py
# Every step is skipped when its output exists. On the 2-core CPU: ~45 min of regeneration (both cores), ~1.5 s
# per step on both cores (~2.5 s on one).
# Env: PY, STEPS (default 4000), OUT (default runs/dflash2_more_data), INIT (default runs/stage10_dflash2/d2/final,
# else runs/same_budget_4000_k2/d2/final), NICE (default 10), THREADS (torch threads for training, default 2).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PY:-python}"
STEPS="${STEPS:-4000}"
OUT="${OUT:-runs/dflash2_more_data}"
RUNNER=(nice -n "${NICE:-10}")
TARGET=flashdraft/assets/default_pair/target
DATA=data/default_pair
MIX="$DATA/regen_more"
INIT="${INIT:-}"
if [ -z "$INIT" ]; then
    INIT=runs/stage10_dflash2/d2/final
    [ -f "$INIT/config.json" ] || INIT=runs/same_budget_4000_k2/d2/final
fi
if [ ! -f "$INIT/config.json" ]; then
    echo "more_data.sh: no DFlash2 run to continue at $INIT (build_drafter.sh stage 10 makes one)" >&2
    exit 2
fi

echo "== [1/3] data -> $MIX"
if [ ! -f "$DATA/coverage_prompts.jsonl" ] || [ "$(wc -l < "$DATA/coverage_prompts.jsonl")" -lt 16000 ]; then
    "$PY" scripts/default_pair/prompts.py --train 4000 --heldout 64 --coverage 16000
fi
regen() {  # regen OUTPUT_DIR PROMPTS LIMIT SHARD [flags...]: complete shards are skipped
    "${RUNNER[@]}" "$PY" -m flashdraft.cli regenerate --target "$TARGET" --data "$2" --limit "$3" \
        --output-dir "$1" --max-new-tokens 128 --batch-size 32 --shard-size "$4" --device cpu "${@:5}"
}
regen "$DATA/regen_mix" "$DATA/train_prompts.jsonl" 4000 500
regen "$DATA/regen_cov" "$DATA/coverage_prompts.jsonl" 10500 250
regen "$DATA/regen_t1_s0" "$DATA/train_prompts.jsonl" 4000 500 --temperature 1.0 --seed 0
regen "$DATA/regen_t1_s1" "$DATA/train_prompts.jsonl" 4000 500 --temperature 1.0 --seed 1
mkdir -p "$MIX"
for part in mix cov t1_s0 t1_s1; do
    for f in "$DATA/regen_$part"/shard-*.jsonl; do ln -sf "../regen_$part/$(basename "$f")" "$MIX/$part-$(basename "$f")"; done
done

echo "== [2/3] train -> $OUT ($STEPS steps from $INIT)"
if [ ! -f "$OUT/final/config.json" ]; then
    resume=()
    [ -d "$OUT/checkpoints" ] && resume=(--resume)
    OMP_NUM_THREADS="${THREADS:-2}" "${RUNNER[@]}" "$PY" -m flashdraft.cli train --target "$TARGET" --data "$MIX" \
        --init-from "$INIT" --output-dir "$OUT" --block-size 16 --num-draft-layers 2 --target-layer-ids 0,1,2,3 \
        --max-steps "$STEPS" --batch-size 4 --max-length 2048 --num-anchors 32 --start-anchors 8 --lr 1e-4 --seed 4 \
        --distill-weight 1.0 --save-every 250 --device cpu --arch dflash2 --conv-kernel-size 2 \
        --selector-top-k 8192 --selector-rank 128 --selector-lr 1.5e-3 --selector-distill-weight 1.0 "${resume[@]}"
fi

echo "== [3/3] evaluate"
[ -f "$OUT/tau_T0/results.json" ] || "${RUNNER[@]}" "$PY" scripts/drafter/eval_tau.py --draft "$OUT/final" \
    --threads 2 --num 32 --label more-data --out "$OUT/tau_T0"
[ -f "$OUT/tau_T1/results.json" ] || "${RUNNER[@]}" "$PY" scripts/drafter/eval_tau.py --draft "$OUT/final" \
    --threads 2 --num 32 --temperature 1 --lengths prompt,256,1024 --label more-data --out "$OUT/tau_T1"
for t in T0 T1; do
    echo "== T = ${t#T}: the shipped DFlash2 drafter against it continued on more data"
    "$PY" scripts/dflash2/compare_tau.py "shipped=docs/bench/default_dflash2/dflash2_tau_$t.json" \
        "more-data=$OUT/tau_$t/results.json" | tee "$OUT/compare_$t.md"
done
