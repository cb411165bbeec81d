"""Test support shipped with mlx_ferrum.

- :mod:`.metal_harness`: runs ``mx.fast.metal_kernel`` sources on a CPU (clang-19).
- :mod:`.paged_cases`: random paged-attention problems and a float64 numpy oracle.
"""
