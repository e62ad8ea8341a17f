import os

# Must be set before the Triton kernels are decorated, so they run in the CPU interpreter.
os.environ["TRITON_INTERPRET"] = "1"
