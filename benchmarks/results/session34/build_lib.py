"""Builds the CPU engine's native library from a csrc folder into a given file, the units compiled in
parallel (hybridmoe/cpu/build.py compiles them one after the other): for A/B runs of two kernel versions in
one device call, each process picking its library with HYBRIDMOE_CPU_LIB.

    python3 build_lib.py CSRC_DIR TARGET.so
"""

import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from hybridmoe.cpu import build  # noqa: E402

csrc, target = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
cxx = build._compiler()
with tempfile.TemporaryDirectory() as d:
    def one(unit):
        src, flags, required = unit
        obj = Path(d) / (src.rsplit(".", 1)[0] + ".o")
        res = subprocess.run([cxx, *build.BASE_FLAGS, *flags, "-c", str(csrc / src), "-o", str(obj)],
                             capture_output=True, text=True)
        if res.returncode and required:
            raise RuntimeError(f"{src}: {res.stderr[:2000]}")
        return obj if res.returncode == 0 else None
    with ThreadPoolExecutor(16) as ex:
        objs = [o for o in ex.map(one, build.UNITS) if o is not None]
    build.link(objs, target, cxx)
print(f"built {target} from {csrc} ({len(objs)} units)")
