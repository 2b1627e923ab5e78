#!/usr/bin/env bash
# A drafter for structured traffic: the shipped drafter fine-tuned on the shipped target's own answers under the JSON
# schema of scripts/speed/structured_cost.py (regenerated with `flashdraft regenerate --json-schema`), to out-of-domain
# code prompts (not the held-out prompts it is measured on), then measured against the shipped drafter on the
# held-out prompts under that schema.
#   bash docs/bench/structured/json_drafter.sh          (PY, OUT, N, STEPS override the defaults)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$ROOT"
PY="${PY:-python}"
OUT="${OUT:-runs/json_drafter}"
N="${N:-512}"
STEPS="${STEPS:-300}"
TARGET=flashdraft/assets/default_pair/target
mkdir -p "$OUT"
"$PY" - "$OUT" "$N" <<'PYEOF'
import json, sys
sys.path.insert(0, "scripts/speed")
from structured_cost import CONSTRAINTS
from flashdraft.bench.datasets import load_prompts
out, n = sys.argv[1], int(sys.argv[2])
open(f"{out}/schema.json", "w").write(CONSTRAINTS["json_schema"].json_schema)
with open(f"{out}/prompts.jsonl", "w") as f:  # past the first 64: the out-of-domain benchmark set stays unseen
    for p in load_prompts("ood-code", n + 64)[64:]:
        f.write(json.dumps({"prompt": p.text}) + "\n")
PYEOF
"$PY" -m flashdraft.cli regenerate --target "$TARGET" --data "$OUT/prompts.jsonl" --output-dir "$OUT/regen" \
    --max-new-tokens 96 --batch-size 32 --json-schema "$OUT/schema.json" --device cpu
"$PY" -m flashdraft.cli train --target "$TARGET" --data "$OUT/regen" --output-dir "$OUT/run" \
    --init-from flashdraft/assets/default_pair/drafter --block-size 16 --num-draft-layers 2 --target-layer-ids 0,1,2,3 \
    --max-steps "$STEPS" --batch-size 4 --max-length 2048 --num-anchors 32 --start-anchors 8 --lr 1.5e-4 --seed 0 \
    --export-dtype bfloat16 --device cpu
for draft in "" "$OUT/run/final"; do
    "$PY" scripts/speed/structured_cost.py --batch 1 --num-prompts 32 --max-tokens 64 --rounds 2 \
        --constraints none,json_schema ${draft:+--draft "$draft"}
done
