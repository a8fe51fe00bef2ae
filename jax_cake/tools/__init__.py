"""Operational tools beside the library: benchmark, tuner, memory floors, build comparison
and the multi-GPU check. Each is a command (`python -m jax_cake.tools.<name>`); the
library (`jax_cake.api` and the layers below it) never imports them."""
