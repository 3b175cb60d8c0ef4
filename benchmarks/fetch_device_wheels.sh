#!/usr/bin/env bash
# Downloads into .whl (git-ignored) the wheels the device image lacks (Python 3.12, no network there), at the
# versions installed in the current environment, for `run` calls that carry ".whl": run_device_suite.sh installs
# them into /tmp/site and puts that on PYTHONPATH. Needed by the server tests, bench_serving and the grammar GPU
# tests (fastapi 0.165 imports opentelemetry-api: without it tests/lora/test_lora_server.py did not collect there;
# without gguf, `import gguf` in the tests once found the tests/gguf folder, since renamed tests/gguf_io).
#   . /tmp/venv/bin/activate && bash benchmarks/fetch_device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
want='xgrammar|apache-tvm-ffi|fastapi|starlette|uvicorn|pydantic|pydantic-core|openai|httpx|httpcore|truststore|jiter'
want+='|jsonschema|jsonschema-specifications|referencing|rpds-py|attrs|annotated-types|typing-inspection|anyio|sniffio'
want+='|h11|httpx2|httpcore2|prometheus-client|click|annotated-doc|certifi|idna|orjson|opentelemetry-api|gguf'
pkgs=$(python -m pip list --format=freeze 2>/dev/null | sed 's/_/-/g' | grep -i -E "^($want)==" | tr '\n' ' ')
[ -n "$pkgs" ] || { echo "none of the packages is installed in this environment" >&2; exit 2; }
mkdir -p .whl
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pkgs
echo "$(ls .whl/*.whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl"
