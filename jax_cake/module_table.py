"""The generated variant tables of the handlers: one generator for both kernel families.

The build writes, next to the exported kernels, one `.inc` per family that its handler
file includes after defining the table's entry and argument types:

  jax_cake_variants.inc         (ffi/jax_cake_ffi.cc: `Variant kVariants[]`, GemmArgs), from
                                jax_cake/planner/variants.py;
  jax_cake_router_variants.inc  (ffi/router_ffi.cc: `RouterVariantEntry kRouterVariants[]`,
                                RouterArgs), from jax_cake/planner/router_variants.py.

Each holds the exported headers' includes, one module, loader and launcher per variant
(jax_cake/kernels/c_table.py), and the table that ffi/module_table.h loads and the
handlers search. A `TableSpec` says what differs between the two families; `write_table`
is the one generator. Plain Python: no cutlass import.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Callable, Sequence

from jax_cake import contract
from jax_cake.kernels import c_table  # plain Python, no cutlass


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """What one family's generated table looks like to its handler file."""

    file: str  # the .inc the handler file includes
    namespaces: tuple[str, ...]  # the table's C++ namespace (the loaders live in <namespaces>::gen)
    entry_type: str  # the handler file's table entry struct
    array: str  # the table's name
    count: str  # the constant holding its length
    args_type: str  # the launchers' argument struct
    operands: tuple[tuple[str, str], ...]  # (args_type member, exported wrapper tensor), wrapper order
    scalar_args: str  # the wrapper's remaining arguments before the stream, as C expressions of `g`
    fields: Callable[[object], str]  # a variant's entry initialisers between its name and its loader
    # A second table in one library replaces the first one's error hook.
    undef_first: bool = False


def _dense_fields(v) -> str:
    from jax_cake.planner.variants import OUTPUT_PROMOTE_EVERY

    dtype = contract.OUT_DTYPE_ENUMERATORS[v.out_dtype]
    promote_every = OUTPUT_PROMOTE_EVERY if v.promote_in == "output" else 0
    return (
        f'"{v.table_program}", {v.tile_m}, {v.tile_n}, {v.tile_k}, {v.cluster_m}, {v.cluster_n}, '
        f"{dtype}, {contract.STORES[v.store]}, {contract.SCHEDULES[v.schedule]}, {promote_every}"
    )


def _router_fields(v) -> str:
    return f'"{v.program}", {v.tile_m}, {v.tile_n}, {v.tile_k}'


DENSE = TableSpec(
    file="jax_cake_variants.inc",
    namespaces=("jax_cake",),
    entry_type="Variant",
    array="kVariants",
    count="kNumVariants",
    args_type="GemmArgs",
    operands=(("a", "mA"), ("b", "mB"), ("c", "mC"), ("aux", "mAux"), ("table", "mTable")),
    scalar_args="g.splits, g.raster, g.max_ctas",
    fields=_dense_fields,
)

ROUTER = TableSpec(
    file="jax_cake_router_variants.inc",
    namespaces=("jax_cake", "router"),
    entry_type="RouterVariantEntry",
    array="kRouterVariants",
    count="kNumRouterVariants",
    args_type="RouterArgs",
    operands=(("a", "mA"), ("a_lo", "mA_lo"), ("b", "mB"), ("b_lo", "mB_lo"), ("c", "mC")),
    scalar_args="g.splits, g.max_ctas",
    fields=_router_fields,
    undef_first=True,
)


def table_text(spec: TableSpec, variants: Sequence) -> str:
    """The .inc text of `variants` (each has `name`, the exported function prefix) in table order."""
    lines = c_table.error_hook_lines("jax_cake/module_table.py", [*spec.namespaces, "gen"], spec.undef_first)
    lines += [f'#include "{v.name}.h"' for v in variants]
    lines.append(" ".join(f"namespace {ns} {{" for ns in (*spec.namespaces, "gen")))
    for v in variants:
        lines += c_table.launcher_lines(v.name, spec.args_type, list(spec.operands), spec.scalar_args)
    lines.append("}  // namespace gen")
    lines.append(f"static const {spec.entry_type} {spec.array}[] = {{")
    lines += [f'  {{"{v.name}", {spec.fields(v)}, gen::load_{v.name}, gen::launch_{v.name}}},' for v in variants]
    lines.append("};")
    lines.append(f"static constexpr int {spec.count} = {len(variants)};")
    lines += [f"}}  // namespace {ns}" for ns in reversed(spec.namespaces)]
    return "\n".join(lines) + "\n"


def write_table(spec: TableSpec, variants: Sequence, obj_dir) -> pathlib.Path:
    """Writes `spec.file` for `variants` into `obj_dir`; returns its path."""
    path = pathlib.Path(obj_dir) / spec.file
    path.write_text(table_text(spec, variants))
    return path


def write_variant_table(variants: Sequence, obj_dir) -> pathlib.Path:
    """jax_cake_variants.inc (the dense GEMM variants)."""
    return write_table(DENSE, variants, obj_dir)


def write_router_variant_table(variants: Sequence, obj_dir) -> pathlib.Path:
    """jax_cake_router_variants.inc (the BF16x3 router variants)."""
    return write_table(ROUTER, variants, obj_dir)
