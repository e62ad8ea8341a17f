"""Structured output: what a request constrains its output to (spec.py), the grammar backend
that turns it into a per-sequence matcher (backend.py, llguidance_backend.py), the compile
cache (compiler.py), and the allowed-token bitmask the sampler applies (bitmask.py)."""
