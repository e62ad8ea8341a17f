"""The model worker. Its package import limits OpenMP spinning (openmp_spin.py) first, because
that only takes effect if it happens before anything here imports torch."""
from kvrelay.worker.openmp_spin import limit_openmp_spinning

limit_openmp_spinning()
