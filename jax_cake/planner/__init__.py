"""Trace-time planning: which program runs each jax_cake GEMM, and why.

  plan_type.py    the Plan (what one GEMM call runs; its FFI attributes)
  choose.py       plan(): the rules and table lookups that choose a Plan
  overrides.py    force(): pins for the benchmark and the tuner
  explanation.py  explain(): a Plan in plain words
  grouped.py      the grouped (ragged, MoE) GEMMs' plans and their explanation
  tables.py       the measured plan tables (xla, wgrad split and fwd/dgrad tile rows)
  variants.py, router_variants.py  what the native library holds (plain data)
  device.py       the device a plan is made for
"""

from jax_cake.planner.choose import plan
from jax_cake.planner.device import DeviceInfo
from jax_cake.planner.explanation import explain
from jax_cake.planner.overrides import force
from jax_cake.planner.plan_type import Plan
from jax_cake.planner.tables import use_table

__all__ = ["DeviceInfo", "Plan", "explain", "force", "plan", "use_table"]
