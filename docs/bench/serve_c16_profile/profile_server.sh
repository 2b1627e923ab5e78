#!/bin/bash
# profile one server (args: name port extra-serve-flags...) under c16 held-out greedy load
name=$1; port=$2; shift 2
cd /work/main
.venv/bin/python -m flashdraft.cli serve --port $port "$@" > /tmp/srv_$name.log 2>&1 &
pid=$!
for i in $(seq 1 120); do curl -s localhost:$port/health >/dev/null 2>&1 && break; sleep 1; done
# warm load first
.venv/bin/python -m flashdraft.cli bench --server http://127.0.0.1:$port --concurrency 16 --num-prompts 32 --max-new-tokens 64 --no-plots --no-progress --output-dir /tmp/bench_prof > /dev/null 2>&1
.venv/bin/py-spy record -p $pid -r 200 -f raw -o /tmp/prof_$name.txt -d 25 --nonblocking > /dev/null 2>&1 &
spy=$!
sleep 1
for r in 1 2 3; do .venv/bin/python -m flashdraft.cli bench --server http://127.0.0.1:$port --concurrency 16 --num-prompts 32 --max-new-tokens 64 --no-plots --no-progress --output-dir /tmp/bench_prof 2>&1 | grep -E "tok/s|throughput" | head -3; done
wait $spy
kill $pid
