"""Benchmarks on real training runs: `python -m bench` (see bench/__main__.py)."""
