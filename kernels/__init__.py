"""pdserve kernels."""
