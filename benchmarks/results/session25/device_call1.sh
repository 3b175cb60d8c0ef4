set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /tmp/w.log 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/b.log 2>&1 || tail -5 /tmp/b.log
git log --oneline | head -1; nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"; date +%T
echo "== align gpu tests"; timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_moe.py -k align 2>&1 | tail -3
echo "== bench_align"; timeout 120 python3 benchmarks/bench_align.py --out $OUT/align.json 2>&1 | grep -v Warning | tail -24
echo "== ttft align A/B ($(date +%T))"; timeout 200 python3 benchmarks/profile_decode.py --prefill 128 --align-ab --top 20 2>&1 | grep -v Warning | tail -40
echo "== gguf amx vs avx512 ($(date +%T))"; for r in 1 2; do for isa in amx avx512; do timeout 80 python3 benchmarks/bench_gguf_moe.py --types Q4_K,Q8_0 --T 1024,4096 --isa $isa --layers 2 --seconds 0.5 --json $OUT/gguf_large_${isa}_$r.json 2>&1 | grep -v Warning | tail -5 | sed "s/^/[$isa r$r] /"; done; done
echo "== gguf tests on amx ($(date +%T))"; HYBRIDMOE_CPU_ISA=amx HYBRIDMOE_TEST_THREADS=8 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gguf -x --tb=line 2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" | head -8
date +%T
