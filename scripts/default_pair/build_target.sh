#!/usr/bin/env bash
# Builds the shipped default target into flashdraft/assets/default_pair/target/:
#   1. corpus     (scripts/default_pair/corpus.py)     -> data/default_pair/corpus/   (seconds)
#   2. tokenizer  (scripts/default_pair/tokenizer.py)  -> tokenizer.json + config     (seconds)
#   3. target LM  (scripts/default_pair/train_target.py) -> model.safetensors, README.md card (~35 min on 2 CPU cores)
# Each step is skipped when its outputs exist, unless --force is given.
# Usage: scripts/default_pair/build_target.sh [--force] [extra train_target.py flags...]
#   PY=/path/to/python to choose the interpreter (its stdlib is the corpus); NICE=10 to lower priority.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PY:-python}"
NICE="${NICE:-0}"
FORCE=()
EXTRA=()
for a in "$@"; do
    if [ "$a" = "--force" ]; then FORCE=(--force); else EXTRA+=("$a"); fi
done

# The configuration the shipped target was trained with (see the model card for the reasons).
TRAIN_ARGS=(
    --hidden 256 --layers 4 --heads 4 --kv-heads 2 --head-dim 64 --intermediate 768
    --max-pos 2048 --rope-theta 10000
    --seq-len 256 --batch-size 16 --lr 2e-3 --warmup-steps 50 --min-lr-ratio 0.1 --weight-decay 0.1
    --minutes 35 --seed 0
)

echo "== [1/3] corpus"
"$PY" scripts/default_pair/corpus.py "${FORCE[@]}"
echo "== [2/3] tokenizer"
"$PY" scripts/default_pair/tokenizer.py "${FORCE[@]}"
echo "== [3/3] target model"
nice -n "$NICE" "$PY" scripts/default_pair/train_target.py "${TRAIN_ARGS[@]}" "${EXTRA[@]}" "${FORCE[@]}"
