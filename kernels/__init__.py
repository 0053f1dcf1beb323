"""pdserve kernels: Triton kernels, each with a launcher that checks its inputs and a pure-torch
reference of the same function (kernels/reference.py).

Kernels are compiled for CUDA when a GPU is present; without one they run in Triton's
interpreter. Which of the two is decided once per process, before triton is first imported,
by an explicit call from the entry points and test setup (kernels/triton_mode.py); importing
this package changes nothing. kernels/ops.py gathers the launchers in one namespace.
"""
