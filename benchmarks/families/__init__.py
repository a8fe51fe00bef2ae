"""The benchmark's families (`python -m benchmarks.bench --family=NAME`): one module each,
with what it measures, its arms and its table; benchmarks/harness.py is the protocol they
share. A new family is a module here whose FAMILY (a harness.Family) benchmarks/bench.py
lists."""
