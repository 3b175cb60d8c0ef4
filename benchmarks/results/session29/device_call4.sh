#!/usr/bin/env bash
# session 29 call 4 (the last ~190 s): the CPU MoE op at T 1 with k 2, 4, 8 experts a task (a deferral-2 step
# runs a ~4-expert and a ~2-expert task a layer): is a small task slower per byte?
python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/hm_build.log 2>&1 || { tail -5 /tmp/hm_build.log; exit 1; }
for k in 2 4 8 2 4 8; do
  timeout 25 python3 benchmarks/bench_cpu_moe.py --method AMXINT8 --T 1 --k $k --layers 4 --seconds 0.4 --profile 2>&1 | grep -E "^ AMXINT8" | sed "s/^/[k $k] /"
done
