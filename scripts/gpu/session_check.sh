#!/usr/bin/env bash
# A device-machine session's GPU checks, in stages with their own time limits, so one that fails or runs long
# leaves the others' results. Logs and JSON are written to $WORK and, after every stage, packed into one file,
# $OUT/gpu_check.tar (the device tool returns only a few files from $OUT); wheels in .whl (transformers >= 5.23
# when the machine's is older) are installed first; fetch them here and carry `.whl` (git-ignored via
# .git/info/exclude):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "transformers>=5.23,<6"
# STAGES picks and orders them (default: all, in this order):
#   STAGES="trace_bf16 trace_bf16_1thread trace_fp32 demo_bf16" bash scripts/gpu/session_check.sh   # ~4 min
#   # the engines without cuDNN's attention (their default) against with it (BENCHMARKS, 'cuDNN attention off'):
#   STAGES="trace_bf16 trace_bf16_cudnn profile_c32 profile_c32_cudnn concurrency concurrency_cudnn" bash ...
#   # what a 16-32-row drafting cycle issues (launches, syncs, GPU busy time) against a plain step, ~2 min:
#   STAGES="cycle_ops" bash scripts/gpu/session_check.sh
#   # the confidence trim where verification is compute-bound (BENCHMARKS, 'Confidence trim'), ~5 min:
#   STAGES="concurrency_trim" bash scripts/gpu/session_check.sh
#   # issue 16's 4,000-step DFlash-1 / DFlash2 pair trained on the GPU, both arms at once (the CPU needs ~3 h); carry
#   # the regenerated data (data/default_pair/{coverage_prompts.jsonl,regen_mix,regen_cov,regen_t1_s0}: ~36 MB); the
#   # final drafters and their training logs come back in the tar, evaluated here with same_budget_pair.sh:
#   STAGES="train_pair" bash scripts/gpu/session_check.sh
#   bash scripts/gpu/session_check.sh     # every stage: their limits add to ~35 min, more than one device call runs
set -uo pipefail
OUT="${OUT:-runs/gpu_check}"; WORK="${WORK:-${TMPDIR:-/tmp}/gpu_check_stages}"; mkdir -p "$OUT" "$WORK"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ALL="trace_bf16 trace_bf16_cudnn trace_bf16_1thread trace_fp32 profile_c32 profile_c32_cudnn noise_152k
     cuda_graphs moe_cuda flex_training demo_fp32 demo_bf16 shapes_eager concurrency concurrency_cudnn concurrency_t1
     concurrency_trim shapes_compiled divergence_bf16 cycle_ops"
stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s) $(date +%T)"
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" > "$WORK/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - t0))s"; tail -n "${TAIL:-25}" "$WORK/$name.log"
    tar -cf "$OUT/gpu_check.tar" -C "$WORK" .
}
run_stage() {
    case $1 in
    trace_bf16) stage $1 60 python3 scripts/gpu/policy_trace.py --dtype bfloat16 --json "$WORK/$1.json" ;;
    trace_bf16_cudnn) stage $1 60 python3 scripts/gpu/policy_trace.py --dtype bfloat16 --cudnn-attention \
        --json "$WORK/$1.json" ;;
    profile_c32) stage $1 150 python3 scripts/gpu/serve_profile.py --concurrency 32 --top 12 --out "$WORK/$1" ;;
    profile_c32_cudnn) stage $1 150 python3 scripts/gpu/serve_profile.py --concurrency 32 --top 12 \
        --cudnn-attention --out "$WORK/$1" ;;
    trace_bf16_1thread) stage $1 60 python3 scripts/gpu/policy_trace.py --dtype bfloat16 --threads 1 \
        --json "$WORK/$1.json" ;;
    trace_fp32) stage $1 60 python3 scripts/gpu/policy_trace.py --dtype float32 --json "$WORK/$1.json" ;;
    noise_152k) stage $1 60 python3 scripts/speed/sampling_cost.py --device cuda --vocab 151936 \
        --shapes 1x1,16x1,32x1,1x16,4x16,16x16 ;;
    cuda_graphs) stage $1 200 python3 -m pytest -q -p no:cacheprovider \
        tests/test_compile.py::test_cuda_graphs_lossless_while_rows_come_and_go_in_place ;;
    moe_cuda) stage $1 200 python3 -m pytest -q -p no:cacheprovider -k "cuda" \
        tests/test_compile.py::test_compiled_mixture_of_experts_target_is_lossless_and_eager_experts_are_refused ;;
    flex_training) stage $1 150 python3 -m pytest -q -p no:cacheprovider \
        tests/test_train_cli.py::test_flex_training_on_gpu_matches_sdpa ;;
    demo_fp32) stage $1 60 python3 -m flashdraft.cli demo --device cuda --dtype float32 --json "$WORK/$1.json" ;;
    demo_bf16) stage $1 60 python3 -m flashdraft.cli demo --device cuda --json "$WORK/$1.json" ;;
    shapes_eager) stage $1 70 python3 scripts/speed/gpu_shapes.py --modes eager --batch-sizes 1,4,16,32 --tau 6.5 \
        --json "$WORK/$1.json" ;;
    concurrency) stage $1 400 python3 scripts/speed/engine_concurrency.py --device cuda --concurrency 1,16,32 \
        --policies adaptive,never --rounds 2 --num-prompts 32 --warm-full --lockstep --json "$WORK/$1.json" ;;
    concurrency_cudnn) stage $1 400 python3 scripts/speed/engine_concurrency.py --device cuda \
        --concurrency 1,16,32 --policies adaptive,never --rounds 2 --num-prompts 32 --cudnn-attention --warm-full \
        --lockstep --json "$WORK/$1.json" ;;
    concurrency_t1) stage $1 120 python3 scripts/speed/engine_concurrency.py --device cuda --concurrency 1,16 \
        --temperature 1 --sets out-of-domain --policies adaptive,fixed --rounds 2 --num-prompts 32 \
        --json "$WORK/$1.json" ;;
    concurrency_trim) stage $1 300 python3 scripts/speed/engine_concurrency.py --device cuda --concurrency 1,16,32 \
        --policies adaptive,no-trim,never --rounds 2 --num-prompts 32 --max-tokens 32-96 \
        --warm-full --lockstep --json "$WORK/$1.json" ;;
    shapes_compiled) stage $1 240 python3 scripts/speed/gpu_shapes.py --modes compiled --batch-sizes 1,16 \
        --tau 6.5 --iters 10 --json "$WORK/$1.json" ;;
    divergence_bf16) stage $1 240 python3 scripts/lossless/divergence.py --device cuda --dtypes bfloat16 \
        --num-prompts 32 --json "$WORK/$1.json" ;;
    cycle_ops) stage $1 150 python3 scripts/gpu/cycle_ops.py --device cuda --rows 1,16,32 --json "$WORK/$1.json" ;;
    train_pair) stage $1 560 bash -c 'for arm in d1 d2; do
            ONLY=$arm PY=python3 DEVICE=cuda NICE=0 EVAL=0 OUT=/tmp/pair bash scripts/dflash2/same_budget_pair.sh \
                > "$1/train_$arm.log" 2>&1 &
        done; wait
        for arm in d1 d2; do mkdir -p "$1/pair/$arm"; cp /tmp/pair/$arm/train_log.jsonl "$1/pair/$arm/" 2>/dev/null
            [ -d /tmp/pair/$arm/final ] && cp -r /tmp/pair/$arm/final "$1/pair/$arm/"; done' _ "$WORK" ;;
    *) echo "unknown stage $1 (stages: $ALL)"; return 2 ;;
    esac
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.get_device_name())"
for name in ${STAGES:-$ALL}; do run_stage "$name"; done
echo "=== done $(date +%T)"
