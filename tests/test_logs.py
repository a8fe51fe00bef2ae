"""jax_cake's log lines: on the "jax_cake" logger, each said once per process."""

import logging

import jax_cake as jc
from jax_cake import logs
from helpers import faked_device


def test_a_line_is_said_once_per_values_until_forgotten(caplog):
    logs.forget()
    with caplog.at_level(logging.INFO, logger="jax_cake"):
        for _ in range(3):
            logs.once(logging.INFO, "jax_cake: test line %s", "a")
        logs.once(logging.INFO, "jax_cake: test line %s", "b")
        logs.forget()
        logs.once(logging.INFO, "jax_cake: test line %s", "a")
    said = [(r.name, r.getMessage()) for r in caplog.records]
    assert said == [("jax_cake", f"jax_cake: test line {v}") for v in "aba"]


def test_the_planners_fallback_lines_are_on_the_jax_cake_logger(caplog):
    """A plan that runs the XLA path says why on "jax_cake" (silenced with that logger)."""
    logs.forget()
    with faked_device(), caplog.at_level(logging.INFO, logger="jax_cake"):
        jc.plan("fwd", tokens=37, d_in=20, d_out=12)  # unaligned: the XLA path
    assert any(r.name == "jax_cake" and "XLA path" in r.getMessage() for r in caplog.records), caplog.records
    logs.forget()
    logging.getLogger("jax_cake").setLevel(logging.ERROR)
    try:
        with faked_device(), caplog.at_level(logging.INFO):
            caplog.clear()
            jc.plan("fwd", tokens=37, d_in=20, d_out=12)
    finally:
        logging.getLogger("jax_cake").setLevel(logging.NOTSET)
    assert not [r for r in caplog.records if r.name == "jax_cake"]
