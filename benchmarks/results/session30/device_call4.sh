#!/usr/bin/env bash
# session 30 call 4 (H100 host, warm after call 3): the GPU stream test with merged tasks added to its rows
bash benchmarks/run_device_suite.sh "$OUT" build >/dev/null 2>&1; timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/cpu/test_hybrid.py -k "stream_path_on_cuda" -rf 2>&1 | tail -4
# printed: 2 passed, 64 deselected in 18.53s
