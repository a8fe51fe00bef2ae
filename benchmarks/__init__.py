"""jax_cake's lab, beside the library and outside its wheel: the benchmark
(`python -m benchmarks.bench`, one harness and a family per capability), the tuners that
write the plan table (`benchmarks.tune`, `benchmarks.tune_tiles`, the rule in
`benchmarks.plan_rule`), the memory floor (`benchmarks.memory_floor`) and the report that
generates docs/benchmarks.md's tables from the CSVs in benchmarks/data/
(`benchmarks.report`). Run each from the repository root as `python -m benchmarks.<name>`;
jax_cake never imports any of it."""
