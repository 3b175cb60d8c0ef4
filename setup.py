"""Builds the CPU expert engine's native library (hybridmoe/cpu/_hybridmoe_cpu.so) on pip install.

A plain C++17 shared library loaded with ctypes (no Python C API, no torch headers); each ISA's
kernels are compiled in their own unit with their own flags, which setuptools' Extension cannot
express, so build_ext is overridden to drive the compiler through hybridmoe/cpu/build.py.
"""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_hybridmoe_cpu_build", ROOT / "hybridmoe" / "cpu" / "build.py")
cpu_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu_build)


class BuildCpuLibrary(build_ext):
    def build_extension(self, ext):
        target = Path(self.get_ext_fullpath(ext.name))
        objs = cpu_build.compile_units(Path(self.build_temp) / "hybridmoe_cpu", log=lambda m: print(m))
        cpu_build.link(objs, target)


setup(
    ext_modules=[Extension("hybridmoe.cpu." + cpu_build.LIB_BASENAME, sources=[])],
    cmdclass={"build_ext": BuildCpuLibrary},
)
