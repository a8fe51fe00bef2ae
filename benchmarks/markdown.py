"""Markdown tables for the benchmarks' and tuners' reports: the table syntax and the way a
number is printed, written once for every tool."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def number(v: Any, digits: int = 3) -> str:
    """A cell's text: "n/a" for None; a float with 1 decimal from 100 up, 2 from 10 up and
    `digits` below (microseconds and ratios keep their significant figures); str() else."""
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.1f}" if v >= 100 else (f"{v:.2f}" if v >= 10 else f"{v:.{digits}f}")
    return str(v)


def row(cells: Iterable[Any]) -> str:
    """One table line; cells that are not text go through number()."""
    return "| " + " | ".join(c if isinstance(c, str) else number(c) for c in cells) + " |"


def table(columns: Sequence[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    """The header, the separator and one line per row (cells as in row())."""
    return [row(columns), "|" + "---|" * len(columns), *(row(r) for r in rows)]


def dict_table(columns: Sequence[str], rows: Iterable[dict]) -> list[str]:
    """table() of dicts keyed by column name; a missing key is "n/a"."""
    return table(columns, ([r.get(c) for c in columns] for r in rows))
