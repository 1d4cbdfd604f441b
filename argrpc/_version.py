"""The one place argrpc's version is written: pyproject.toml reads it at build time
(``[tool.setuptools.dynamic]``), ``argrpc.__version__`` and both CLIs' ``--version`` import
it. A literal on purpose: setuptools reads it without importing argrpc (which needs the
compiled engine)."""

__version__ = "0.1.0"
