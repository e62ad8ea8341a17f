"""Service tests: each service as a real process on free localhost ports."""
