"""jax_cake's log lines: the "jax_cake" logger, and the lines said once per process.

A fallback or a separate pass is explained the first time its exact values come (its
device, shape and reason), not at every trace. Silence or raise them as any logger's:
logging.getLogger("jax_cake").setLevel(logging.ERROR).
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("jax_cake")


@functools.cache
def _say(level: int, message: str, args: tuple) -> None:
    logger.log(level, message, *args)


def once(level: int, message: str, *args) -> None:
    """logger.log(level, message, *args) the first time these values come; after that,
    nothing. args are hashable (strings, numbers)."""
    _say(level, message, args)


def forget() -> None:
    """Say every line again next time (for tests that look for a line)."""
    _say.cache_clear()
