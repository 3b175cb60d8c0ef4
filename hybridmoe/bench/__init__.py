"""`hybridmoe bench`: `one-batch` (prefill and decode latency of one batch, in process), `serving`
(concurrent clients against an HTTP server) and `shape` (write a published model shape's config.json
for random-weight runs and `hybridmoe check --model`)."""

from __future__ import annotations

import sys

USAGE = ("usage: hybridmoe bench {one-batch,serving,shape} ...\n"
         "  one-batch  prefill and decode latency of one batch (like SGLang's bench_one_batch)\n"
         "  serving    concurrent clients against a server (like SGLang's bench_serving)\n"
         "  shape      write a published model shape's config.json (random-weight runs, check --model)")


def bench_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd, rest = (argv[0], argv[1:]) if argv else (None, [])
    if cmd == "one-batch":
        from hybridmoe.bench.one_batch import main

        return main(rest)
    if cmd == "serving":
        from hybridmoe.bench.serving import main

        return main(rest)
    if cmd == "shape":
        from hybridmoe.bench.shape_cli import main

        return main(rest)
    if cmd in ("-h", "--help"):
        print(USAGE)
        return 0
    # one line, as every other flag error of the project (the usage block is --help's)
    what = "a sub-command is required" if cmd is None else f"unknown sub-command {cmd!r}"
    print(f"hybridmoe bench: error: {what}; expected one-batch, serving or shape (see hybridmoe bench --help)",
          file=sys.stderr)
    return 2
