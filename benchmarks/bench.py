"""The benchmark: jax_cake's ops against XLA (and cuBLAS), one family per invocation.

    python -m benchmarks.bench --tokens=16384 --d_in=4096 --d_out=48 --ops=wgrad,bwd --csv=out/dense.csv
    python -m benchmarks.bench --family=router --md=out/router.md
    python -m benchmarks.bench --family=model --cases=mlp,block --runs=3
    python -m benchmarks.bench --merge=out/a.csv,out/b.csv --md=out/all.md   # one table, nothing run

Run it from the repository root (it imports this checkout's jax_cake). Families
(`--family`, benchmarks/families/<name>.py says what each measures):

- dense: dense_projection against XLA's dot and cuBLAS (the default);
- router: router_logits (BF16x3) against XLA's BF16_BF16_F32_X3 and HIGHEST dots;
- batched: batched_projection against einsum and torch.bmm;
- residual: y = r + x w^T, the add in the forward kernel against a separate add and XLA;
- accumulate: micro-batch gradient accumulation, the sum in the wgrad kernel;
- gated: the SwiGLU / GeGLU forward, the activation in the GEMM epilogue;
- grouped_gated: the MoE experts' SwiGLU / GeGLU forward, the activation in the grouped
  GEMM's epilogue;
- grouped: grouped_projection (MoE experts) against XLA's, cuDNN's and tokamax's ragged dot
  and a dense GEMM of the same FLOPs;
- core: every fwd/dgrad GEMM variant forced against XLA's dot at the Llama shapes
  (its CSV feeds `python -m benchmarks.tune_tiles`);
- model: whole training steps (value_and_grad and Adam) against idiomatic XLA.

All of them measure by one protocol (benchmarks/harness.py): a child process per run and
mode (g = CUDA graphs, e = eager), the arms interleaved in paired groups, an L2 flush
before every step, CUPTI device time (host wall time without a GPU, labelled so),
medians. Each family has its own defaults for the protocol's flags (--runs, --modes,
--groups, --steps); a flag that the chosen family does not read is refused.
"""

from __future__ import annotations

import sys

from absl import app, flags

from benchmarks import harness, plan_rule
from benchmarks.families import (
    accumulate,
    batched,
    core,
    dense,
    gated,
    grouped,
    grouped_gated,
    model,
    residual,
    router,
)
from jax_cake.reference import ACTIVATIONS

FAMILIES = {
    f.name: f
    for f in (
        dense.FAMILY,
        router.FAMILY,
        batched.FAMILY,
        residual.FAMILY,
        accumulate.FAMILY,
        gated.FAMILY,
        grouped.FAMILY,
        grouped_gated.FAMILY,
        core.FAMILY,
        model.FAMILY,
    )
}
# The flags some family reads: each is refused where the chosen family does not read it.
FAMILY_FLAGS = tuple(dict.fromkeys(name for f in FAMILIES.values() for name in f.reads))
TIMING_FLAGS = ("groups", "steps", "flush_mb", "timer")
FLAGS = flags.FLAGS


def define_flags() -> None:
    harness.define_protocol_flags()
    harness.define_grid_flags(arms_default=dense.ARMS)
    flags.DEFINE_enum("family", "dense", list(FAMILIES), "What to measure (the module docstring lists them).")
    flags.DEFINE_list("ops", list(dense.OPS), "Ops, from the family's (dense, router, batched, core).")
    flags.DEFINE_list("experts", [str(e) for e in harness.GRID_EXPERTS], "router: expert counts E (--d_in gives d).")
    flags.DEFINE_list("batch", ["16", "128"], "batched: batch sizes B.")
    flags.DEFINE_list("pairs", ["128:512", "512:128"], "batched, core: d_in:d_out pairs (core: the Llama shapes).")
    flags.DEFINE_integer("micro_batches", 4, "accumulate: micro-batches per step (the scan length).")
    flags.DEFINE_enum("activation", "silu", list(ACTIVATIONS), "gated, grouped_gated: the gated activation.")
    flags.DEFINE_string("only", "", "core: time only the variants whose arm name matches this regex (e.g. 'pp_c2').")
    flags.DEFINE_list("rasters", [], "core: also time each variant with these tile walks (m, n, m<B>).")
    flags.DEFINE_bool("allow_few_reps", False, "core: allow --groups x --steps < 15.")
    model.define_flags()
    grouped.define_flags()
    grouped_gated.define_flags()
    flags.DEFINE_string("csv", None, "Write the table as CSV here.")
    flags.DEFINE_string("md", None, "Write the markdown table here.")
    flags.DEFINE_list("merge", None, "dense, router, batched: CSVs of earlier runs; print one table over their rows.")


def configure(family: harness.Family) -> None:
    """Refuses flags the family does not read, then sets its defaults where not given."""
    stray = [n for n in FAMILY_FLAGS if FLAGS[n].present and n not in family.reads]
    if stray:
        raise app.UsageError(f"--family={family.name} does not take {', '.join('--' + n for n in stray)}")
    for name, value in family.defaults.items():
        if not FLAGS[name].present:
            setattr(FLAGS, name, value)


def emit(report: harness.Report) -> None:
    """Prints the table; writes it to --md and --csv when given; exits 1 if a check failed."""
    print(report.text)
    if FLAGS.md:
        with open(FLAGS.md, "w") as f:
            f.write(report.text)
    if FLAGS.csv:
        harness.write_csv(FLAGS.csv, report.columns, report.rows)
    if report.failed:
        print(report.failed, file=sys.stderr)
        sys.exit(1)


def main(argv):
    del argv
    family = FAMILIES[FLAGS.family]
    configure(family)
    if FLAGS.merge:
        if family.merge is None:
            raise app.UsageError(f"--merge: --family={family.name} has no merged table")
        emit(family.merge(FLAGS.merge))
        return
    family.check()
    modes = harness.selected("modes", plan_rule.MODES)
    if FLAGS.child_out:  # one (run, mode) of the parent's
        timer_kind = FLAGS.timer or harness.default_timer()
        samples = family.child(modes[0], FLAGS.run_index, timer_kind)
        harness.write_child_output(FLAGS.child_out, harness.device_header(timer_kind), samples)
        return
    argv = harness.child_argv(["family", *TIMING_FLAGS, *family.reads])
    if family.parent is not None:
        header, samples = family.parent(argv, modes)
    else:
        header, samples = harness.run_children("benchmarks.bench", argv, modes, FLAGS.runs)
    emit(family.report(header, samples))


if __name__ == "__main__":
    define_flags()
    app.run(main)
