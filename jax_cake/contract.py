"""The names and codes of the FFI boundary (docs/ffi_contract.md), defined once.

Python imports them from here (the planner, the primitives, the library loader, the
build). The C++ handlers include `jax_cake_codes.h`, which the build generates from
this module (`write_header`) before it compiles ffi/*.cc, so the handlers never spell a
code or a target name themselves; tests/test_contract.py fails where they do.

Plain data: importing this module imports neither jax nor cutlass.
"""

from __future__ import annotations

import pathlib

# --- integer attributes -------------------------------------------------------------------
# The `reduction` attribute: how the K splits of an output tile are summed.
REDUCTION_NONE = 0  # one pass over K (splits == 1)
REDUCTION_ORDERED = 1  # fp32 partials [splits, B, M, N] in the workspace, then a reduce pass in split order
REDUCTION_ARRIVAL = 2  # arrival order: TMA reduce-add (fp32) stores; not bitwise reproducible
REDUCTION_SPLIT_TAIL = 3  # the last partial wave's tiles cut into K pieces, summed in piece order in the kernel
# Plan.reduction's names for the codes.
REDUCTIONS = {
    "none": REDUCTION_NONE,
    "ordered": REDUCTION_ORDERED,
    "arrival": REDUCTION_ARRIVAL,
    "split_tail": REDUCTION_SPLIT_TAIL,
}

# The `schedule` attribute: how a variant's CTAs walk their work (GemmVariant.schedule).
SCHEDULE_TILES = 0  # each CTA walks whole tiles (or K splits of them)
SCHEDULE_SPLIT_TAIL = 1  # whole waves, then the tail's tiles cut along K (wgrad, with REDUCTION_SPLIT_TAIL)
SCHEDULE_PINGPONG = 2  # the two consumer warpgroups take whole tiles in turns (fwd/dgrad)
SCHEDULES = {"tiles": SCHEDULE_TILES, "split_tail": SCHEDULE_SPLIT_TAIL, "pingpong": SCHEDULE_PINGPONG}

# The `raster` attribute: the order of the CTAs' walk over the tiles. Tiles are walked in
# bands of B cluster rows of M tiles (the last band may be shorter): M fastest within a
# band, then N, then the next band. Code 0 walks M first over all of M (one band); code 1
# is bands of one row (N first); a code B from 2 to RASTER_BAND_MAX is bands of B rows,
# which keeps a wave's A rows and B rows both few where neither operand fits in L2.
# Plan.raster names them "m", "n" and "m<B>" (raster_code).
RASTER_M = 0
RASTER_N = 1
RASTERS = {"m": RASTER_M, "n": RASTER_N}
RASTER_BAND_MAX = 65535


def raster_code(raster: str) -> int:
    """The `raster` attribute's code of a Plan.raster name: "m" -> 0, "n" -> 1, "m<B>" -> B
    (bands of B cluster rows, 2 <= B <= RASTER_BAND_MAX)."""
    if not isinstance(raster, str):
        raise TypeError(f"raster must be a str ('m', 'n' or 'm<B>'), got {type(raster).__name__}")
    if raster in RASTERS:
        return RASTERS[raster]
    band = raster[1:]
    if raster[:1] == "m" and band.isdigit() and 2 <= int(band) <= RASTER_BAND_MAX and band[0] != "0":
        return int(band)
    raise ValueError(f"raster must be 'm', 'n' or 'm<B>' with B in [2, {RASTER_BAND_MAX}], got {raster!r}")


def describe_raster(raster: str) -> str:
    """The tile walk of a Plan.raster name in words, for plan reasons."""
    code = raster_code(raster)
    if code == RASTER_M:
        return "tiles walk along M first"
    if code == RASTER_N:
        return "tiles walk along N first"
    return f"tiles walk in bands of {code} cluster rows, M first within a band"


# The `activation` attribute of jax_cake_fwd_gated and jax_cake_dgrad_gated: the gated
# epilogue's act in h = act(g) * u, or the one whose gradient the dgrad epilogue applies
# (jax_cake.reference.ACTIVATIONS; gelu is the tanh form).
ACTIVATION_SILU = 0
ACTIVATION_GELU = 1
ACTIVATION_CODES = {"silu": ACTIVATION_SILU, "gelu": ACTIVATION_GELU}
# The tanh-form GELU's constants (jax.nn.gelu(approximate=True)): sqrt(2 / pi) and the
# cubic's; the reference and the kernel epilogue compute the same function with them.
GELU_C = 0.7978845608028654
GELU_A = 0.044715

# The gated epilogue's layout (jax_cake_fwd_gated): the stacked weight holds gate and up
# rows interleaved in blocks of GATE_BLOCK rows (jax_cake.reference.interleave), so every
# 32-column sub-tile of the kernel's accumulator is 16 gate columns, then the up columns
# of the same d_ff indices, held by the same threads at the same register positions.
GATE_BLOCK = 16

# A variant's epilogue in the generated variant table (Variant::store), GemmVariant.store:
# "plain" (TMA store), "add" (TMA reduce-add), "gated_<act>" (the gated epilogue: the
# pre-activation and h = act(g) * u, two outputs), "gate_grad_<act>" (the dgrad epilogue
# d[gate|up] from dh and the saved pre-activation), "gate_up_halves" (a plain store of a
# dgrad whose K runs over two operand pairs: dx of the gated projection from dg, du and
# the gate and up rows of the interleaved weight, jax_cake_dgrad_gate_up).
STORES = {"plain": 0, "add": 1, "gated_silu": 2, "gated_gelu": 3, "gate_grad_silu": 4, "gate_up_halves": 5}

# A variant's output dtype in the generated variant table (the `out_dtype` of its entry).
OUT_BF16 = 0
OUT_F32 = 1
OUT_DTYPES = {"bfloat16": OUT_BF16, "float32": OUT_F32}
OUT_DTYPE_ENUMERATORS = {"bfloat16": "kBf16", "float32": "kF32"}  # their C++ names

# --- FFI targets and library symbols ------------------------------------------------------
FWD_TARGET = "jax_cake_fwd"
DGRAD_TARGET = "jax_cake_dgrad"
WGRAD_TARGET = "jax_cake_wgrad"
# dw = acc + dy^T x in place (acc aliased to dw): gradient accumulation across micro-batches.
WGRAD_ACCUMULATE_TARGET = "jax_cake_wgrad_accumulate"
# y = r + x w^T in place (r aliased to y): the residual add in the forward GEMM's epilogue.
FWD_RESIDUAL_TARGET = "jax_cake_fwd_residual"
# (gu, h): the forward GEMM over interleaved gate and up rows with the gated epilogue.
FWD_GATED_TARGET = "jax_cake_fwd_gated"
# d_gu: the down projection's dgrad dh = dy w_down with the activation's gradient in the
# epilogue, d[gate|up] from dh and the saved pre-activation gu (the gated backward).
DGRAD_GATED_TARGET = "jax_cake_dgrad_gated"
# dx = dg Wg + du Wu: the gated projection's input gradient as ONE GEMM over K = 2F from
# the cotangent's halves dg, du [T, F] and the interleaved weight W [2F, d_in] (its gate
# rows, then its up rows, read in place): no interleaved copy of the cotangent.
DGRAD_GATE_UP_TARGET = "jax_cake_dgrad_gate_up"
# The MoE experts' grouped GEMMs on rows laid out so that each group starts at a multiple
# of GROUP_ROW_ALIGN rows, with an int32 table of the groups' tiles (docs/ffi_contract.md).
GROUPED_FWD_TARGET = "jax_cake_grouped_fwd"
# (gu, h): the grouped forward over each group's interleaved gate and up rows with the
# gated epilogue (the MoE experts' gate/up projection).
GROUPED_FWD_GATED_TARGET = "jax_cake_grouped_fwd_gated"
GROUPED_DGRAD_TARGET = "jax_cake_grouped_dgrad"
GROUPED_WGRAD_TARGET = "jax_cake_grouped_wgrad"
GROUP_ROW_ALIGN = 128  # the grouped variants' tile_m (a multiple of their tile_k, 64)
ROUTER_FWD_TARGET = "jax_cake_router_fwd"
ROUTER_DGRAD_TARGET = "jax_cake_router_dgrad"
ROUTER_WGRAD_TARGET = "jax_cake_router_wgrad"
# Every target the library registers, in registration order.
TARGETS = (
    FWD_TARGET,
    DGRAD_TARGET,
    WGRAD_TARGET,
    WGRAD_ACCUMULATE_TARGET,
    FWD_RESIDUAL_TARGET,
    FWD_GATED_TARGET,
    DGRAD_GATED_TARGET,
    DGRAD_GATE_UP_TARGET,
    GROUPED_FWD_TARGET,
    GROUPED_FWD_GATED_TARGET,
    GROUPED_DGRAD_TARGET,
    GROUPED_WGRAD_TARGET,
    ROUTER_FWD_TARGET,
    ROUTER_DGRAD_TARGET,
    ROUTER_WGRAD_TARGET,
)


def handler_symbol(target: str) -> str:
    """The exported C symbol of a target's handler: the name in CamelCase ("jax_cake_fwd" -> "JaxCakeFwd")."""
    return "".join(part.capitalize() for part in target.split("_"))


# Handler symbols the library must export (the build checks after linking).
HANDLER_SYMBOLS = tuple(handler_symbol(t) for t in TARGETS)
# Exported C functions that load each kernel family's CUDA modules (native.py calls them).
MODULE_LOADERS = ("jax_cake_load_modules", "jax_cake_router_load_modules")
# The shared library the build writes and native.py loads.
LIBRARY_NAME = "libjax_cake_ffi.so"
# GPU architectures with compiled kernels (the build's --arch; others run the XLA path).
KERNEL_ARCHS = ("sm_90a",)
# The handlers are built against the XLA FFI headers of this jaxlib, the oldest supported:
# a handler built with newer headers fails on an older runtime, older headers work on
# newer ones. Part of the cached build's key (native.cache_key).
FFI_HEADERS_JAXLIB = "0.10.2"

# --- the generated C++ header -------------------------------------------------------------
HEADER_NAME = "jax_cake_codes.h"


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _choices(codes) -> str:
    """'0, 1 or 2': the codes as the handlers' error messages list them."""
    codes = [str(c) for c in sorted(codes)]
    return codes[0] if len(codes) == 1 else ", ".join(codes[:-1]) + " or " + codes[-1]


def target_constant(target: str) -> str:
    """The C++ name of a target's name string: "jax_cake_router_fwd" -> kRouterFwdTarget."""
    return "k" + handler_symbol(target)[len("JaxCake") :] + "Target"


def handler_macro(target: str) -> str:
    """The C++ macro naming a target's handler symbol: "jax_cake_fwd" -> JAX_CAKE_FWD_HANDLER."""
    return target.upper() + "_HANDLER"


def header_text() -> str:
    """jax_cake_codes.h: this module's codes and names as C++ constants."""
    lines = [
        "// Generated by jax_cake/contract.py (the one definition of these names); do not edit.",
        "#pragma once",
        "",
        "#include <cstdint>",
        "",
        "namespace jax_cake {",
        "",
    ]

    def codes(comment: str, prefix: str, table: dict) -> None:
        lines.append(f"// {comment}")
        for name, code in table.items():
            lines.append(f"constexpr int64_t k{prefix}{_camel(name)} = {code};")
        lines.append(f"constexpr int64_t kNum{prefix}s = {len(table)};")
        lines.append(f'constexpr const char k{prefix}Choices[] = "{_choices(table.values())}";')
        lines.append("")

    codes("The `reduction` attribute.", "Reduction", REDUCTIONS)
    codes("The `schedule` attribute.", "Schedule", SCHEDULES)
    codes("The `raster` attribute: 0 and 1; codes 2 .. kRasterBandMax are bands of that many rows.", "Raster", RASTERS)
    lines.append(f"constexpr int64_t kRasterBandMax = {RASTER_BAND_MAX};")
    lines.append("")
    codes("The `activation` attribute (jax_cake_fwd_gated, jax_cake_grouped_fwd_gated, jax_cake_dgrad_gated).", "Activation", ACTIVATION_CODES)
    codes("A variant's epilogue (Variant::store in the generated variant table).", "Store", STORES)
    lines.append(
        "// Gate and up rows interleave in blocks of this many rows "
        "(jax_cake_fwd_gated, jax_cake_dgrad_gated, jax_cake_dgrad_gate_up)."
    )
    lines.append(f"constexpr int64_t kGateBlock = {GATE_BLOCK};")
    lines.append("")
    lines.append("// Each group of the grouped targets starts at a multiple of this many rows.")
    lines.append(f"constexpr int64_t kGroupRowAlign = {GROUP_ROW_ALIGN};")
    lines.append("")
    lines.append("// A variant's output dtype (Variant::out_dtype in the generated variant table).")
    enumerators = ", ".join(f"{OUT_DTYPE_ENUMERATORS[name]} = {code}" for name, code in OUT_DTYPES.items())
    lines.append(f"enum OutDtype : int {{ {enumerators} }};")
    lines.append("")
    lines.append("// FFI target names.")
    for t in TARGETS:
        lines.append(f'constexpr const char {target_constant(t)}[] = "{t}";')
    lines.append("")
    lines.append("}  // namespace jax_cake")
    lines.append("")
    lines.append("// Exported handler symbols, for XLA_FFI_DEFINE_HANDLER_SYMBOL.")
    for t in TARGETS:
        lines.append(f"#define {handler_macro(t)} {handler_symbol(t)}")
    return "\n".join(lines) + "\n"


def write_header(directory) -> pathlib.Path:
    """Writes jax_cake_codes.h into `directory` (only when its text changed, so an
    unchanged header keeps its timestamp) and returns its path."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / HEADER_NAME
    text = header_text()
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return path
