#!/usr/bin/env bash
# Everything the H200 machine has to confirm, in few calls (device time is scarce).
# Usage there (OUT is the folder whose files come back):
#   bash benchmarks/run_device_suite.sh "$OUT" [part...]
# Parts (default: all; they run in this order): check gpu-tests cpu-isa-tests sweep decode serving ttft
# hybrid prefill profile cpu-moe server. Not in the default (each takes minutes; name them): cpu-decode
# (issue 21: CPU-only decode on all cores against the stream bound), gguf (issue 18: GGUF experts per
# layer, then hybrid decode of the 48-layer shape from a Q4_K GGUF), lora (issue 17: bench_lora_decode), cpu-attn
# (the CPU-only path's decode attention: the AVX2 and AVX-512 span kernels interleaved, 1K-32K positions, KV out
# of cache, all cores and one; then the dense GEMVs at software prefetch distances 0-8192 B), align (the fused MoE's
# expert grouping methods, benchmarks/bench_align.py), ttft (a 128-token prompt to its first token, all-GPU: eager
# with each align method, prefill graphs off and on, interleaved; profile_decode.py --prefill; with the model's
# routing and with spread routing), mla (issue 15: the MLA decode kernel and the absorbed attention, batch x context,
# checked against the reference first), router (the one-token router: two launches against the fused kernel's
# configs, benchmarks/bench_router.py). `sweep` tunes the MoE decode tiles and writes the table the engine reads
# (moe_sweep.json in OUT holds it), so `decode` after it runs with the tuned tiles. At most 8 files
# come back from OUT: logs that the output tail shows anyway stay in /tmp.
# The acceptance tables of issues 15, 16 and 18 (benchmarks/issue_tables.py OUT) read decode.json, hybrid_decode.json
# (HYBRID_ARGS="--graphs on --repeat 3"), cpu_moe_AMXINT4/8.json (CPU_MOE_ARGS="--T 1,4,16,1024,4096"), serving.json,
# gguf_moe.json, gguf_moe_large.json, hybrid_decode_gguf.json and mla.json, e.g. in two calls:
#   run_device_suite.sh OUT decode serving cpu-moe mla   and   run_device_suite.sh OUT hybrid gguf Server tests and bench_serving need fastapi/uvicorn/pydantic wheels carried in .whl (benchmarks/fetch_device_wheels.sh; see
# the device README); they run only when `python -c "import fastapi"` works.
set -u
out="${1:-/tmp/hybridmoe-device}"
shift || true
parts="${*:-check gpu-tests cpu-isa-tests sweep decode serving ttft hybrid prefill profile cpu-moe server}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log() { echo "== $* ($(date +%T))"; }
want() { [[ " $parts " == *" $1 "* ]]; }
log build
PY=python3  # the image's python3 has torch; a bare `python` may not
if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (fastapi, uvicorn, pydantic, openai, ...)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > /tmp/hm_wheels.log 2>&1 && export PYTHONPATH=/tmp/site
fi
# A machine stays warm between calls and keeps the ignored build outputs: the same native sources built by an
# earlier call of this machine (the stamp) are not built again (~80 s a call on the H100 host, session 34)
digest=$($PY -c "import importlib.util as u; s = u.spec_from_file_location('hm_build', 'hybridmoe/cpu/build.py'); \
m = u.module_from_spec(s); s.loader.exec_module(m); print(m.sources_digest())" 2>/dev/null)
if [ -n "$digest" ] && [ "$(cat /tmp/hm_build.stamp 2>/dev/null)" = "$digest" ] \
    && ls hybridmoe/cpu/_hybridmoe_cpu*.so > /dev/null 2>&1 && $PY -c "import hybridmoe" 2>/dev/null; then
  echo "(native library of these sources built by an earlier call: not built again)"
else
  $PY -m pip install -q --no-build-isolation --no-deps -e . > /tmp/hm_build.log 2>&1 || { tail -30 /tmp/hm_build.log; exit 1; }
  echo "$digest" > /tmp/hm_build.stamp
fi
if want check; then
  log check
  $PY -m hybridmoe.cli check > "$out/check.txt" 2>&1; echo "exit $?" >> "$out/check.txt"; cat "$out/check.txt"
fi
if want gpu-tests; then
  log gpu-tests
  # modules that import fastapi & co. fail to collect where those wheels were not carried: go on without them
  # (their GPU tests are few); -v names each test as it ends, so a run cut by the timeout still says which
  # failed (the tail shows only failures, errors and the summary; the whole list is in gpu_tests.log)
  # GPU_TESTS_WORKERS=N: N pytest-xdist workers, a module per worker (the suite's time is mostly Triton compiling
  # on the CPU, 16 cores there). Default 1 (serial): an engine built without --max-total-tokens sizes its KV cache
  # from the GPU's free memory (85%), so a worker's engine can leave another's none; use N > 1 on test paths
  # whose engines all set max_total_tokens. The serial suite took more than 330 s on the H100 host (session 25: cut
  # at 92%); the default 420 s leaves a call of 600 s room for the build
  workers="${GPU_TESTS_WORKERS:-1}"
  xdist=""
  if [ "$workers" -gt 1 ] && $PY -c "import xdist" 2>/dev/null; then xdist="-n $workers --dist loadfile"; fi
  timeout "${GPU_TESTS_TIMEOUT:-420}" $PY -m pytest -v -p no:cacheprovider -m gpu ${GPU_TESTS_PATHS:-tests} -rf \
    --continue-on-collection-errors $xdist 2>&1 \
    | tee "$out/gpu_tests.log" | grep -E "FAILED|ERROR|passed|failed|^E " | tail -25
fi
if want cpu-isa-tests; then
  log cpu-isa-tests
  for isa in avx2 avx512 amx; do
    # failures with their one-line reason (the summary alone needed a second run to diagnose)
    # 150 s each did not finish tests/cpu on the H100 host (session 24); a collection error must not stop the rest
    HYBRIDMOE_CPU_ISA=$isa HYBRIDMOE_TEST_THREADS=8 timeout "${CPU_ISA_TIMEOUT:-300}" $PY -m pytest -q -p no:cacheprovider \
      tests/cpu --tb=line -rf --continue-on-collection-errors 2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed|error" \
      | head -30 | sed "s/^/[$isa] /"
  done | tee "$out/cpu_isa_tests.log"
fi
if want sweep; then
  log sweep-moe-decode
  timeout "${SWEEP_TIMEOUT:-200}" $PY benchmarks/sweep_moe_decode.py --write --out "$out/moe_sweep.json" 2>&1 \
    | grep -v Warning | tee /tmp/hm_sweep.log | grep -v "^  skip"
fi
if want decode; then
  log bench-decode
  # DECODE_ARGS="--routing spread": tokens reach every expert (random weights route to a few; spread_routing.py)
  timeout "${DECODE_TIMEOUT:-300}" $PY benchmarks/bench_decode.py --steps 48 ${DECODE_ARGS:-} --out "$out/decode.json" 2>&1 \
    | grep -v Warning | tee "$out/bench_decode.log"
fi
has_fastapi=0
$PY -c "import fastapi, uvicorn, pydantic" 2>/dev/null && has_fastapi=1
if want serving; then
  if [ $has_fastapi = 1 ]; then
    log bench-serving
    # overlap scheduling off and on, each level both ways, and the engine's own decode step (one-batch) as the
    # ceiling of ITL p50 (issue 16 point 4); SERVING_FLAGS="" for one server with the defaults
    timeout "${SERVING_TIMEOUT:-420}" $PY benchmarks/bench_serving.py --dummy-qwen3-30b --server-args "${SERVING_ARGS:-}" \
      ${SERVING_FLAGS---overlap-ab --offline-ceiling} --out "$out/serving.json" 2>&1 | grep -v "INFO:" \
      | tee "$out/bench_serving.log" | tail -16
  else
    log "no fastapi here: bench_serving skipped"
  fi
fi
if want ttft; then
  # with the model's routing, then with tokens spread over every expert (what a trained router does; random
  # weights route a prompt to a few experts past layer 0: benchmarks/spread_routing.py)
  for routing in ${TTFT_ROUTINGS:-model spread}; do
    log "prefill-ttft (routing $routing)"
    timeout "${TTFT_TIMEOUT:-240}" $PY benchmarks/profile_decode.py --prefill "${TTFT_TOKENS:-128}" --align-ab \
      --prefill-graph-ab --routing "$routing" --top 12 --out "$out/ttft_$routing.json" 2>&1 | grep -v Warning \
      | tee "/tmp/hm_ttft_$routing.log" | grep -E "prefill|first tokens|per step"
  done
fi
if want hybrid; then
  log bench-hybrid-decode
  timeout "${HYBRID_TIMEOUT:-300}" $PY benchmarks/bench_hybrid_decode.py ${HYBRID_ARGS:-} --out "$out/hybrid_decode.json" \
    2>&1 | grep -v Warning | tee "$out/bench_hybrid_decode.log"
fi
if want prefill; then
  log bench-hybrid-prefill
  timeout "${PREFILL_TIMEOUT:-300}" $PY benchmarks/bench_hybrid_prefill.py ${PREFILL_ARGS:-} --out "$out/hybrid_prefill.json" \
    2>&1 | grep -v Warning | tee "$out/bench_hybrid_prefill.log"
fi
if want profile; then
  log profile-decode
  timeout "${PROFILE_TIMEOUT:-150}" $PY benchmarks/profile_decode.py 2>&1 | grep -v Warning | tail -32
  timeout "${PROFILE_TIMEOUT:-150}" $PY benchmarks/profile_decode.py --gpu-experts 32 2>&1 | grep -v Warning | tail -32
fi
if want cpu-moe; then
  log bench-cpu-moe
  for m in AMXINT8 AMXINT4; do
    timeout 150 $PY benchmarks/bench_cpu_moe.py --method $m ${CPU_MOE_ARGS:-} --out "$out/cpu_moe_$m.json" 2>&1 \
      | grep -v Warning | tail -40
  done | tee "$out/bench_cpu_moe.log"
  for th in ${CPU_MOE_THREADS:-}; do  # e.g. "12 14 15 16": the default thread count is the fastest one
    timeout 100 $PY benchmarks/bench_cpu_moe.py --method AMXINT8 --threads $th --T 1,4,16,1024 --seconds 0.5 2>&1 \
      | tail -5 | sed "s/^/[threads $th] /"
  done
fi
if want server && [ $has_fastapi = 1 ]; then
  log server-tests
  timeout 240 $PY -m pytest -q -p no:cacheprovider tests/server -x 2>&1 | tee "$out/server_tests.log" | tail -5
fi
if want cpu-decode; then
  log bench-cpu-decode
  # device="cpu", every physical core; the split says where a step goes, with the one-call layers' parts
  # (llama.cpp is not on the device); pinned: the caller on the leader's CPU (does sharing a core with a
  # spinning pool thread cost the 16-thread layer call its 3x?); pin pins each decode step there
  # (cpu/caller_pin.py; off by default, as nopin); classic: pool phases wait for every thread; pinned0 (and the
  # leader thread sleeps at once after its tasks: AMX layers queue their MoE task to it); pfN: prefetch N bytes;
  # layers: one call per layer, not stacked
  timeout "${CPU_DECODE_TIMEOUT:-420}" $PY benchmarks/bench_cpu_decode.py --layers "${CPU_DECODE_LAYERS:-12}" \
    --repeats "${CPU_DECODE_REPEATS:-5}" --dense "${CPU_DECODE_MODES:-on,pin,classic,pinned0,pf4096,layers}" --split --no-llama --out "$out/cpu_decode.json" 2>&1 | grep -v Warning \
    | tee "$out/bench_cpu_decode.log" | tail -30
fi
if want cpu-attn; then
  log bench-cpu-attn
  for th in "" 1; do
    timeout "${CPU_ATTN_TIMEOUT:-150}" $PY benchmarks/bench_cpu_attn.py --kernels avx2,avx512 --cold \
      --lens 1024,4096,16384,32768 --repeats 5 ${th:+--threads $th} --out "$out/cpu_attn${th:+_t$th}.json" 2>&1 \
      | grep -v Warning | tail -6 | sed "s/^/[threads ${th:-all}] /"
  done | tee "$out/bench_cpu_attn.log"
  log bench-cpu-dense-prefetch
  timeout "${CPU_DENSE_TIMEOUT:-200}" $PY benchmarks/bench_cpu_dense.py --shapes lm_head qkv o_proj --tokens 1 \
    --isa avx512 --prefetch 0,2048,4096,8192 --repeats 5 --no-torch 2>&1 | grep -v Warning \
    | tee "$out/bench_cpu_dense_prefetch.log" | tail -20
fi
if want gguf; then
  log bench-gguf-moe
  # decode sizes: software prefetch distances interleaved in 3 rounds, the host's default first (`default`: 4096 on
  # Intel with AVX-512 since session 34; issue_tables.py takes that distance's rows); then large T at the default
  timeout "${GGUF_MOE_TIMEOUT:-300}" $PY benchmarks/bench_gguf_moe.py --types Q4_K,Q8_0 --T 1,4,16 --profile \
    --prefetch "${GGUF_PREFETCH:-default,0,2048,4096,8192}" --rounds "${GGUF_ROUNDS:-3}" --json "$out/gguf_moe.json" 2>&1 \
    | grep -v Warning | tee "$out/bench_gguf_moe.log" | grep -E "^(kernel|median)"
  timeout "${GGUF_LARGE_TIMEOUT:-200}" $PY benchmarks/bench_gguf_moe.py --types Q4_K,Q8_0 --T 1024,4096 \
    --json "$out/gguf_moe_large.json" 2>&1 | grep -v Warning | tee -a "$out/bench_gguf_moe.log" | tail -6
  log bench-hybrid-decode-gguf
  # the file (~16 GB at 48 layers) goes to /tmp, not $OUT
  timeout "${GGUF_HYBRID_TIMEOUT:-420}" $PY benchmarks/bench_hybrid_decode.py --gguf "${GGUF_TYPE:-Q4_K}" \
    --gguf-dir /tmp/hm_gguf --deferred 0 --batch 1 4 --graphs on ${GGUF_HYBRID_ARGS:-} \
    --out "$out/hybrid_decode_gguf.json" 2>&1 | grep -v Warning | tee "$out/bench_hybrid_decode_gguf.log" | tail -12
fi
if want align; then
  log bench-align
  # the fused MoE's expert grouping by method (one-program triton, three-kernel grid, sort-based torch): eager
  # wall time a call (what an eager prefill layer pays) and GPU time in a graph; the grid's GPU check first
  timeout 120 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_moe.py -k align 2>&1 | tail -2
  timeout "${ALIGN_TIMEOUT:-150}" $PY benchmarks/bench_align.py --out "$out/align.json" 2>&1 | grep -v Warning \
    | tee "$out/bench_align.log" | tail -24
fi
if want mla; then
  log bench-mla-decode
  timeout "${MLA_TIMEOUT:-240}" $PY benchmarks/bench_mla_decode.py --check --out "$out/mla.json" 2>&1 | grep -v Warning \
    | tee "$out/bench_mla_decode.log" | tail -26
fi
if want router; then
  log bench-router
  timeout "${ROUTER_TIMEOUT:-200}" $PY benchmarks/bench_router.py --out "$out/router.json" 2>&1 | grep -v Warning \
    | tee "$out/bench_router.log" | tail -8
fi
if want lora; then
  log bench-lora-decode
  timeout "${LORA_TIMEOUT:-420}" $PY benchmarks/bench_lora_decode.py ${LORA_ARGS:-} --out "$out/lora_decode.json" \
    2>&1 | grep -v Warning | tee "$out/bench_lora_decode.log" | tail -20
fi
log done
