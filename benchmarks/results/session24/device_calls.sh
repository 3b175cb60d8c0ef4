# ---- call 1
set -u
bash benchmarks/run_device_suite.sh $OUT check 2>&1 | tail -8
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nproc; lscpu | grep -E "Model name"; nvidia-smi --query-gpu=name --format=csv,noheader
echo "== amx kernel tests (real AMX)"; HYBRIDMOE_CPU_ISA=amx HYBRIDMOE_TEST_THREADS=8 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/cpu/test_cpu_kernels.py tests/cpu/test_cpu_fp8.py tests/cpu/test_layer_moe.py --tb=line 2>&1 | tail -6
echo "== int4/int8 large T"; for m in AMXINT4 AMXINT8 AMXINT4; do timeout 100 python3 benchmarks/bench_cpu_moe.py --method $m --T 64,256,1024,4096 --seconds 0.5 --out $OUT/cpu_moe_large_$m.json 2>&1 | grep -v Warning | tail -7; done
echo "== reduce-inline"; timeout 120 python3 benchmarks/bench_cpu_moe.py --method AMXINT8 --T 1,4 --profile --reduce-inline 16,0,16,0 --out $OUT/cpu_moe_reduce.json 2>&1 | grep -v Warning | tail -14
echo "== gguf"; timeout 200 python3 benchmarks/bench_gguf_moe.py --types Q4_K,Q8_0 --T 1,4,16 --profile --rounds 3 --json $OUT/gguf_moe.json 2>&1 | grep -v Warning | tail -30
echo "== mla splits"; for s in 0 8 16 32 64; do timeout 60 python3 benchmarks/bench_mla_decode.py --batches 1 4 --contexts 8192 32768 $( [ $s -gt 0 ] && echo --splits $s ) 2>&1 | grep -v Warning | tail -6 | sed "s/^/[splits $s] /"; done
# ---- call 2
set -u
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/b.log 2>&1 || tail -5 /tmp/b.log
for r in 1 2 3; do for isa in amx avx512; do
timeout 100 python3 benchmarks/bench_cpu_moe.py --method AMXINT4 --isa $isa --T 64,256,1024,4096 --seconds 0.5 --out $OUT/int4_${isa}_$r.json 2>&1 | grep -v Warning | grep -E "AMXINT4|best" | sed "s/^/[$isa r$r] /"
done; done
timeout 100 python3 benchmarks/bench_cpu_moe.py --method AMXINT8 --T 1024,4096 --seconds 0.5 2>&1 | grep -E "AMXINT8|best" | sed "s/^/[int8] /"
timeout 100 python3 benchmarks/bench_cpu_moe.py --method AMXINT4 --T 1024,4096 --seconds 0.5 --profile 2>&1 | grep -E "AMXINT4|best" | sed "s/^/[int4 amx profile] /"
# ---- call 3
set -u
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/b.log 2>&1 || tail -5 /tmp/b.log
for m in AMXINT8 AMXINT4 AMXINT8 AMXINT4; do
timeout 100 python3 benchmarks/bench_cpu_moe.py --method $m --T 1,16,1024,4096 --seconds 0.5 --profile --out $OUT/cpu_moe_$m.json 2>&1 | grep -v Warning | grep -E "AMXINT|best" | cut -c1-250
done
echo "== gguf large"; timeout 150 python3 benchmarks/bench_gguf_moe.py --types Q4_K,Q8_0 --T 1024,4096 --profile --json $OUT/gguf_large.json 2>&1 | grep -v Warning | tail -12
echo "== int4 AMX kernel tests"; HYBRIDMOE_CPU_ISA=amx HYBRIDMOE_TEST_THREADS=8 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/cpu/test_cpu_kernels.py tests/cpu/test_cpu_engine.py --tb=line 2>&1 | tail -3
# ---- call 4
set -u
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /tmp/w.log 2>&1
python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/b.log 2>&1 || tail -5 /tmp/b.log
git log --oneline | head -1
echo "== tests/cpu on real AMX"; HYBRIDMOE_CPU_ISA=amx HYBRIDMOE_TEST_THREADS=8 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/cpu --tb=line 2>&1 | grep -E "^(FAILED|E  )|passed|failed|error" | head -8
echo "== serving"; timeout 380 python3 benchmarks/bench_serving.py --dummy-qwen3-30b --server-args "" --concurrency 1 --num-prompts 8 --overlap-ab --offline-ceiling --out $OUT/serving.json 2>&1 | grep -v "INFO:" | tail -25
# ---- call 5
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /tmp/w.log 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/b.log 2>&1 || tail -5 /tmp/b.log
echo "== tests/cpu on real AMX"; HYBRIDMOE_CPU_ISA=amx HYBRIDMOE_TEST_THREADS=8 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/cpu --tb=line --continue-on-collection-errors 2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" | head -10
echo "== prefill 128 profile"; timeout 170 python3 benchmarks/profile_decode.py --prefill 128 --top 25 2>&1 | grep -v Warning | tail -45
