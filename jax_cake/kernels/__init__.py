"""CuTe DSL kernels for sm_90a, compiled ahead of time by `python -m jax_cake.build`.

Only `variants` may be imported at run time (plain data, no cutlass); the kernel
modules (`gemm_sm90`) import cutlass and are used by the build alone.
"""
