"""Runnable examples of argrpc on real workloads (run from the repository root)."""
