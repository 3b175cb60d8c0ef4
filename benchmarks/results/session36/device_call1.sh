set -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
git log --oneline | head -1
export TRITON_DEFAULT_FP_FUSION=1
timeout 330 python benchmarks/bench_mla_decode.py --sweep --sweep-tiles 64,64,8,2 64,32,8,2 64,16,8,2,2 64,32,8,2,2 64,32,8,3,2 64,32,8,4,2 64,64,8,2,2 64,16,8,4,2 32,64,8,2,1 --out $OUT/mla_sweep.json 2>&1 | grep -v -i "warn"
timeout 200 python -m pytest -q -x -m gpu tests/test_mla_triton_gpu.py -p no:cacheprovider 2>&1 | tail -5
