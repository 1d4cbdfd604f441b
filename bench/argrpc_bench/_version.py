"""argrpc-bench's release: always argrpc's (tests/test_version.py checks the two agree)."""
__version__ = "0.1.0"
