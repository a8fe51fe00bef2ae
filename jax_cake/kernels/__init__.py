"""CuTe DSL kernels for sm_90a, compiled ahead of time by `python -m jax_cake.build`.

The kernel modules import cutlass and are used by the build alone, never at run time;
c_table.py is plain Python (the C++ glue the build's variant tables are made of). The
lists of what they compile (plain data the planner also reads) live in
`jax_cake/planner/variants.py` and `jax_cake/planner/router_variants.py`.
"""
