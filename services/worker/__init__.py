"""The model worker. Its entry module (main.py) limits OpenMP spinning (openmp_spin.py) before
anything else it imports loads torch; the package itself has no side effect, so `kvrelay up` can
read the worker's flags (flags.py) without touching its own environment."""
