"""Builds argrpc: the pybind11 extension argrpc._core from csrc/ and the bootstrap
protobuf module from protos/ (the source of truth)."""
import glob
import os
import subprocess
import sys

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import Command, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def generate_protos() -> None:
    out = os.path.join(HERE, "argrpc", "_proto")
    os.makedirs(out, exist_ok=True)
    for proto in glob.glob(os.path.join(HERE, "protos", "*.proto")):
        subprocess.check_call([sys.executable, "-m", "grpc_tools.protoc",
                               f"-I{os.path.join(HERE, 'protos')}", f"--python_out={out}", proto])


class BuildProtos(Command):
    description = "generate argrpc/_proto/*_pb2.py from protos/"
    user_options: list = []

    def initialize_options(self) -> None: ...

    def finalize_options(self) -> None: ...

    def run(self) -> None:
        generate_protos()


class BuildPy(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()


class BuildExt(build_ext):
    def run(self) -> None:
        generate_protos()  # editable installs skip build_py
        super().run()


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
    cmdclass={"build_ext": BuildExt, "build_py": BuildPy, "build_protos": BuildProtos},
)
