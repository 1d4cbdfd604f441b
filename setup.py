"""Builds argrpc: the pybind11 extension argrpc._core from csrc/. (The bootstrap
messages need no build step: argrpc/_proto/descriptor.py is committed, written from
protos/ by scripts/gen_proto.py.)"""
import glob
import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup


# One compiler per CPU (ARGRPC_BUILD_JOBS=N to say otherwise): the engine is some forty
# translation units, built serially they took most of a set-up.
ParallelCompile("ARGRPC_BUILD_JOBS").install()

sanitize = os.environ.get("ARGRPC_SANITIZE", "")  # e.g. "address,undefined"
extra_compile = ["-O2", "-g", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fvisibility=hidden"]
extra_link: list = []
if sanitize:
    extra_compile += [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-O1"]
    extra_link += [f"-fsanitize={sanitize}"]

ext = Pybind11Extension(
    "argrpc._core",
    sorted(glob.glob("csrc/**/*.cc", recursive=True)),
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=extra_compile,
    extra_link_args=extra_link,
)

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": build_ext},
)
