"""Speculative decoding: model-free proposers in the scheduler, exact verification on the worker."""
