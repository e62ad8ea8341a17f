"""Peers that kvrelay is compared against, each installed in its own virtual environment
outside the project's dependencies (see benchmarks/compare.py for the side-by-side run)."""
