"""Serving benchmark: `hybridmoe bench serving` (hybridmoe/bench/serving.py), kept under this name
for the device suite. `--dummy-qwen3-30b` is `--shape qwen3-30b-a3b`.

    python benchmarks/bench_serving.py --server-args "--device cpu" --concurrency 1 8 32
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --input-len 512 --out r.json
"""

from __future__ import annotations

import sys

from hybridmoe.bench.serving import main

if __name__ == "__main__":
    argv = ["--shape" if a == "--dummy-qwen3-30b" else a for a in sys.argv[1:]]
    if "--shape" in argv:
        argv.insert(argv.index("--shape") + 1, "qwen3-30b-a3b")
    sys.exit(main(argv))
