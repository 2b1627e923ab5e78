# Throwaway (BENCHMARKS, "The served temperature-1 cost, split"): flashdraft bench against servers started
# by serve_variant.py, one level at a time, ROUNDS rounds per level with the server order reversed every other round.
# usage: rounds.sh OUT TEMP CONCS ROUNDS name=url...
out=$1; temp=$2; concs=$3; rounds=$4; shift 4
for c in ${concs//,/ }; do for r in $(seq 1 $rounds); do
  if [ $((r % 2)) = 1 ]; then servers=("$@"); else servers=($(printf '%s\n' "$@" | tac)); fi
  args=(); for s in "${servers[@]}"; do args+=(--server "$s"); done
  flashdraft bench "${args[@]}" --concurrency $c --temperature $temp --max-new-tokens 64 --num-requests 32 --output-dir $out/c${c}_r$r --no-plots --no-progress 2>&1 | grep "│ " | sed "s/^/c$c r$r /"
done; done
