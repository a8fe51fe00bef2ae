"""Trace-time planning: which program runs each jax_cake GEMM, and why."""

from jax_cake.planner.device import DeviceInfo
from jax_cake.planner.planning import Plan, explain, force, plan
from jax_cake.planner.tables import use_table

__all__ = ["DeviceInfo", "Plan", "explain", "force", "plan", "use_table"]
