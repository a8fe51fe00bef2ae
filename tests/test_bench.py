"""benchmarks.bench on CPU: the CLI's table and CSV, the timed programs, the timeline split (the harness)."""

import csv
import os
import re
import subprocess
import sys
import tempfile
from unittest import mock

import jax
from absl.testing import absltest, parameterized

from helpers import REPO, faked_device
from benchmarks import harness, plan_rule
from benchmarks.families import batched, dense, projections, router

TABLES = {"router": router.TABLE, "batched": batched.TABLE}
PROJECT = {"dense": dense.project, "router": router.project, "batched": batched.project}


def run_cli(*argv: str) -> tuple[str, list[dict]]:
    """`python -m benchmarks.bench *argv` at 1 run, 2 steps, 1 MiB flush: (markdown, CSV rows)."""
    with tempfile.TemporaryDirectory() as tmp:
        md, csv_path = os.path.join(tmp, "b.md"), os.path.join(tmp, "b.csv")
        subprocess.run(
            [sys.executable, "-m", "benchmarks.bench", *argv, "--runs=1", "--steps=2", "--flush_mb=1"]
            + [f"--md={md}", f"--csv={csv_path}"],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        with open(csv_path) as f:
            return open(md).read(), list(csv.DictReader(f))


class CliTest(parameterized.TestCase):
    def test_tiny_shape_writes_markdown_and_csv(self):
        text, rows = run_cli("--tokens=64", "--d_in=128", "--d_out=32", "--out_dtype=float32", "--groups=2")
        first = text.splitlines()[0]
        self.assertIn("host wall time (no GPU)", first)
        self.assertIn(f"jax {jax.__version__}", first)
        self.assertRegex(first, r"\d{4}-\d{2}-\d{2}")
        self.assertIn("| " + " | ".join(dense.COLUMNS) + " |", text)
        table = [l for l in text.splitlines() if l.startswith("| none")]
        self.assertLen(table, len(dense.OPS) * len(plan_rule.MODES))
        self.assertEqual({l.split(" | ")[5] for l in table}, set(dense.OPS))
        self.assertRegex(text, r"- wgrad g \(1 rows\): det/new \d+\.\d{3} \(")

        self.assertEqual(list(rows[0]), list(dense.COLUMNS))
        self.assertLen(rows, len(dense.OPS) * len(plan_rule.MODES))
        for r in rows:
            self.assertEqual((r["d_in -> d_out"], r["out"], r["T"]), ("128 -> 32", "FP32", "64"))
            for column in ("det us", "split us", "XLA us", "new us"):
                self.assertGreater(float(r[column]), 0)
            self.assertAlmostEqual(float(r["det/new"]), float(r["det us"]) / float(r["new us"]), places=9)
            self.assertEqual(r["cuBLAS us"], "")  # no CUDA torch here

    def test_a_flag_the_family_does_not_read_is_refused(self):
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench", "--family=router", "--out_dtype=float32"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("--family=router does not take --out_dtype", out.stderr)

    @parameterized.named_parameters(
        (
            "router",
            ["--family=router", "--tokens=64", "--d_in=128", "--experts=32"],
            ("d -> E", "T"),
            ("128 -> 32", "64"),
            ("XLA x3", "XLA highest"),
        ),
        (
            "batched",
            ["--family=batched", "--batch=2", "--tokens=64", "--pairs=32:64"],
            ("B", "d_in -> d_out", "T"),
            ("2", "32 -> 64", "64"),
            ("det", "XLA", "cuBLAS"),
        ),
    )
    def test_other_families(self, argv, shape_columns, shape, baselines):
        family = TABLES[argv[0].split("=")[1]]
        text, rows = run_cli(*argv, "--groups=1")
        columns = ("GPU", "SMs", *shape_columns, "op", "mode")
        columns += tuple(f"{b} us" for b in baselines) + ("new us",) + tuple(f"{b}/new" for b in baselines)
        self.assertEqual(family.columns, columns)
        self.assertIn("host wall time (no GPU)", text.splitlines()[0])
        self.assertIn("| " + " | ".join(columns) + " |", text)
        self.assertRegex(text, rf"- {re.escape(family.ops[-1])} e \(1 rows\): {baselines[0]}/new \d+\.\d{{3}} \(")
        self.assertEqual(list(rows[0]), list(columns))
        self.assertEqual(sorted((r["op"], r["mode"]) for r in rows), sorted((o, m) for o in family.ops for m in "eg"))
        for r in rows:
            self.assertEqual(tuple(r[c] for c in shape_columns), shape)
            self.assertGreater(float(r["new us"]), 0)
            self.assertAlmostEqual(
                float(r[f"{baselines[0]}/new"]), float(r[f"{baselines[0]} us"]) / float(r["new us"]), places=9
            )
            if "cuBLAS" in baselines:
                self.assertEqual(r["cuBLAS us"], "")  # no CUDA torch here
            else:
                self.assertGreater(float(r["XLA highest us"]), 0)


class StepFamiliesTest(parameterized.TestCase):
    """The families whose arms are whole steps run through the same CLI, table and CSV."""

    @parameterized.named_parameters(
        ("residual", ["--family=residual"], ("d_in -> d_out", "T", "mode"), "| 128 -> 128 | 64 | g |"),
        (
            "accumulate",
            ["--family=accumulate", "--micro_batches=2"],
            ("d_in -> d_out", "T", "micro-batches", "mode"),
            "| 128 -> 128 | 64 | 2 | g |",
        ),
    )
    def test_step_family_writes_markdown_and_csv(self, argv, lead, line):
        text, rows = run_cli(*argv, "--tokens=64", "--d_in=128", "--d_out=128", "--groups=2", "--modes=g")
        self.assertIn("host wall time (no GPU)", text.splitlines()[0])
        self.assertIn(line, text)
        (row,) = rows
        arms = ("fused us", "separate us", "xla us", "separate/fused", "xla/fused")
        self.assertEqual(tuple(row), lead + arms)
        self.assertAlmostEqual(float(row["xla/fused"]), float(row["xla us"]) / float(row["fused us"]), places=9)


class StepsProgramTest(parameterized.TestCase):
    """XLA must run every timed step: no CSE of the repeated op, flush between steps."""

    @parameterized.product(
        arm=["det", "xla"], op_and_dots=[("fwd", 1), ("dgrad", 1), ("wgrad", 1), ("bwd", 2), ("2fwd+bwd", 4)]
    )
    def test_every_step_runs_between_flushes(self, arm, op_and_dots):
        if jax.__version_info__ < harness.STEPS_KEPT_SINCE:
            self.skipTest(f"jax {jax.__version__} merges the repeated steps; the harness refuses to time on it")
        op, dots = op_and_dots
        steps = 3
        args = harness.make_inputs(harness.Point(64, 128, 32, "float32"), flush_mb=1)
        text = harness.compile_arm(harness.parse_arm(arm), op, steps, args, dense.project).as_text()
        sequence = ""  # the schedule: F = flush, D = a GEMM (a dot, or a kCustom fusion of one on CPU)
        for line in text[text.index("ENTRY") :].splitlines():
            if "xor_fusion" in line.split("=")[0]:
                sequence += "F"
            elif re.search(r"= \S+ dot\(", line) or "kind=kCustom" in line:
                sequence += "D"
        self.assertEqual(sequence, ("D" * dots + "F") * steps)


class RequireStepsKeptTest(absltest.TestCase):
    def test_refuses_to_time_on_a_gpu_with_an_old_jax(self):
        with mock.patch.object(jax, "__version_info__", (0, 10, 2)):
            harness.require_steps_kept()  # on the CPU: nothing is timed
            with mock.patch.object(jax, "default_backend", lambda: "gpu"):
                with self.assertRaisesRegex(RuntimeError, "need jax >= 0.11 to time on a GPU"):
                    harness.require_steps_kept()


class ArmsLowerForTheH200Test(parameterized.TestCase):
    """Each arm's timed program, lowered for CUDA on a faked H200, runs the program it names."""

    @parameterized.named_parameters(
        ("det", "det", "1"),  # ordered reduction: bitwise reproducible
        ("split", "split", "2"),  # arrival order
        ("split_8", "split/s8", "2"),
    )
    def test_wgrad_reduction_and_splits(self, arm, reduction):
        steps = 2
        args = [
            jax.ShapeDtypeStruct(a.shape, a.dtype)
            for a in harness.make_inputs(harness.Point(16384, 4096, 48, "float32"), flush_mb=128)
        ]
        spec = harness.parse_arm(arm)
        with faked_device(), harness.planning_for(spec):
            program = harness.steps_program(harness.op_fn("2fwd+bwd", dense.project(spec)), steps)
            text = jax.jit(program).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        calls = re.findall(r"@(jax_cake_\w+)", text)
        self.assertEqual(
            sorted(calls), sorted(["jax_cake_fwd"] * 2 * steps + ["jax_cake_dgrad", "jax_cake_wgrad"] * steps)
        )
        self.assertEqual(set(re.findall(r"reduction = (\d+)", text)), {"0", reduction})  # fwd/dgrad: 0
        if spec.splits:
            self.assertIn(f"splits = {spec.splits} ", text)

    def test_router_and_batched_arms(self):
        """new (and batched det) run jax_cake's kernels (the fused BF16x3 router on an
        H200); XLA's arms keep their precision in the gradients."""
        steps = 2
        router = harness.Point(16384, 4096, 256, "float32", family="router")
        cases = (  # point, op, new's primitives per step (one GEMM each)
            (router, "fwd+bwd", ["router_fwd", "router_dgrad", "router_wgrad"]),
            (router, "dgrad", ["router_dgrad"]),
            (router, "wgrad", ["router_wgrad"]),
            (router, "bwd", ["router_dgrad", "router_wgrad"]),
            (harness.Point(4096, 128, 512, "bfloat16", 16, "batched"), "2fwd+bwd", ["fwd", "fwd", "dgrad", "wgrad"]),
        )
        for point, op, gemms in cases:
            args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in harness.make_inputs(point, flush_mb=128)]
            for arm in TABLES[point.family].arms:
                if arm == "cublas":
                    continue
                with faked_device():
                    program = harness.steps_program(
                        harness.op_fn(op, PROJECT[point.family](harness.parse_arm(arm))), steps
                    )
                    text = jax.jit(program).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
                calls = re.findall(r"@jax_cake_(\w+)", text)
                dots = re.findall(r"dot_general.*", text)
                with self.subTest(family=point.family, arm=arm):
                    if arm in ("new", "det"):
                        self.assertEqual(sorted(calls), sorted(gemms * steps))
                        self.assertEmpty(dots)
                    else:
                        self.assertEmpty(calls)
                        self.assertLen(dots, len(gemms) * steps)
                        marker = {"xla_x3": "num_primitive_operations = 3", "xla_highest": "[HIGHEST, HIGHEST]"}
                        for dot in dots:
                            self.assertIn(marker.get(arm, "[DEFAULT, DEFAULT]"), dot)


def ev(start, end, name):
    return (start, end, name)


class StepSpansTest(absltest.TestCase):
    markers = {"loop_xor_fusion"}

    def test_a_step_is_first_begin_to_last_end_before_its_flush(self):
        events = [
            ev(21, 30, "gemm"),
            ev(31, 40, "reduce"),
            ev(41, 50, "loop_xor_fusion_1"),
            ev(52, 60, "gemm"),
            ev(61, 70, "loop_xor_fusion"),
        ]
        self.assertEqual(harness.step_spans(events, self.markers, calls=1, steps=2), [[(21, 40), (52, 60)]])

    def test_back_to_back_calls_and_multi_kernel_flushes(self):
        a, b = "flush_a", "flush_b"
        events = [ev(3, 9, "gemm"), ev(10, 11, a), ev(11, 12, b), ev(16, 19, "gemm"), ev(20, 21, a), ev(21, 22, b)]
        self.assertEqual(
            harness.step_spans(events, {a, b}, calls=2, steps=1, kernels_per_flush=2), [[(3, 9)], [(16, 19)]]
        )

    def test_wrong_flush_count_names_the_kernels(self):
        events = [ev(0, 1, "gemm"), ev(2, 3, "loop_xor_fusion")]
        with self.assertRaisesRegex(RuntimeError, r"found 1 flushes, expected 2 .*gemm"):
            harness.step_spans(events, self.markers, calls=1, steps=2)

    def test_a_step_whose_op_was_dropped_is_an_error(self):
        events = [ev(0, 1, "gemm"), ev(2, 3, "loop_xor_fusion"), ev(4, 5, "loop_xor_fusion")]
        with self.assertRaisesRegex(RuntimeError, "no device events"):
            harness.step_spans(events, self.markers, calls=1, steps=2)


class ArmsAndReportTest(absltest.TestCase):
    def test_parse_arm(self):
        self.assertEqual(
            harness.parse_arm("split/s16/t64x256x64"),
            harness.ArmSpec("split/s16/t64x256x64", "split", 16, (64, 256, 64)),
        )
        self.assertEqual(harness.split_arm_name(16, (64, 256, 64)), "split/s16/t64x256x64")
        self.assertEqual(harness.parse_arm("det").kind, "det")
        self.assertEqual(harness.parse_arm("det/pp"), harness.ArmSpec("det/pp", "det", schedule="pingpong"))
        self.assertEqual(harness.parse_arm("det/tiles"), harness.ArmSpec("det/tiles", "det", schedule="tiles"))
        self.assertEqual(
            harness.parse_arm("det/pp/c2"), harness.ArmSpec("det/pp/c2", "det", schedule="pingpong", cluster=(2, 1))
        )
        self.assertEqual(
            harness.parse_arm("det/t128x128x64"), harness.ArmSpec("det/t128x128x64", "det", tile=(128, 128, 64))
        )
        for bad in ("det/s4", "split/x3", "cutlass", "new/pp", "new/t128x128x64", "det/t128x128"):
            with self.assertRaises(ValueError):
                harness.parse_arm(bad)

    def test_grid_covers_every_combination(self):
        points = harness.grid_points(harness.GRID_TOKENS, harness.GRID_D_IN, harness.GRID_D_OUT, harness.OUT_DTYPES)
        self.assertLen(points, 3 * 2 * 6 * 2)
        self.assertLen(set(points), len(points))

    def test_medians_ratios_and_geomeans(self):
        point = dict(tokens=16384, d_in=4096, d_out=48, out="float32")
        samples = []
        for run, scale in enumerate((1.0, 1.1, 5.0)):  # run 2 is an outlier: the median over runs ignores it
            for arm, us in (("det", 40.0), ("new", 20.0), ("xla", 60.0)):
                samples.append(
                    {
                        **point,
                        "op": "wgrad",
                        "mode": "g",
                        "run": run,
                        "arm": arm,
                        "groups_us": [us * scale, us * scale * 2, us * scale * 0.5],
                    }
                )
        header = {
            "gpu": "H200",
            "sms": 132,
            "driver": "580.159.04",
            "jax": "0.11.2",
            "date": "2026-11-29",
            "timer": harness.DEVICE_LABEL,
        }
        (row,) = projections.table_rows(dense.TABLE, header, samples)
        self.assertAlmostEqual(row["new us"], 22.0)
        self.assertAlmostEqual(row["det/new"], 2.0)
        self.assertAlmostEqual(row["XLA/new"], 3.0)
        self.assertIsNone(row["cuBLAS/new"])
        text = projections.markdown(dense.TABLE, header, [row])
        self.assertTrue(text.startswith("GPU H200, 132 SMs, driver 580.159.04, jax 0.11.2, 2026-11-29"))
        self.assertIn("- wgrad g (1 rows): det/new 2.000 (2.000 to 2.000); XLA/new 3.000", text)
        self.assertIn(
            "| H200 | 132 | 4096 -> 48 | FP32 | 16384 | wgrad | g | 44.00 | n/a | 66.00 | n/a | 22.00 | 2.000 |"
            " 3.000 | n/a |",
            text,
        )

    def test_arms_with_options_get_their_own_columns(self):
        point = dict(tokens=16384, d_in=5120, d_out=512, out="float32")
        samples = [
            {**point, "op": "wgrad", "mode": "g", "run": 0, "arm": arm, "groups_us": [us, us]}
            for arm, us in (("new", 140.0), ("xla", 117.0), ("split/s1/t64x128x64", 217.0))
        ]
        header = {"gpu": "H200", "sms": 132, "driver": "d", "jax": "0.11.2", "date": "2026-11-30"}
        header["timer"] = harness.DEVICE_LABEL
        (row,) = projections.table_rows(dense.TABLE, header, samples)
        self.assertAlmostEqual(row["split/s1/t64x128x64 us"], 217.0)
        self.assertAlmostEqual(row["split/s1/t64x128x64/new"], 217.0 / 140.0)
        columns = projections.report_columns(dense.TABLE, [row])
        self.assertEqual(columns[: len(dense.COLUMNS)], list(dense.COLUMNS))
        self.assertEqual(columns[len(dense.COLUMNS) :], ["split/s1/t64x128x64 us", "split/s1/t64x128x64/new"])
        text = projections.markdown(dense.TABLE, header, [row])
        self.assertIn("| 217.0 | 1.550 |", text)
        self.assertIn("split/s1/t64x128x64/new 1.550", text)

    def test_merge_recomputes_geomeans_over_the_files_rows(self):
        header = {"gpu": "H200", "sms": 132, "driver": "d", "jax": "0.11.2", "date": "2026-11-30"}
        header["timer"] = harness.DEVICE_LABEL
        with tempfile.TemporaryDirectory() as tmp:
            paths = []
            # the third file re-measures the first file's point: its row replaces that one
            for tokens, new_us in ((16172, 20.0), (16384, 80.0), (16172, 40.0)):
                point = dict(tokens=tokens, d_in=4096, d_out=48, out="float32")
                samples = [
                    {**point, "op": "wgrad", "mode": "g", "run": 0, "arm": arm, "groups_us": [us, us]}
                    for arm, us in (("new", new_us), ("xla", 40.0))
                ]
                paths.append(os.path.join(tmp, f"{tokens}_{len(paths)}.csv"))
                rows = projections.table_rows(dense.TABLE, header, samples)
                harness.write_csv(paths[-1], projections.report_columns(dense.TABLE, rows), rows)
            md = os.path.join(tmp, "all.md")
            subprocess.run(
                [sys.executable, "-m", "benchmarks.bench", f"--merge={','.join(paths)}", f"--md={md}"],
                cwd=REPO,
                check=True,
                capture_output=True,
            )
            text = open(md).read()
        self.assertTrue(text.startswith("Rows merged from 16172_0.csv, 16384_1.csv, 16172_2.csv"))
        # XLA/new is 1.0 (the re-measured 16172 row) and 0.5: two rows, the first in its place
        self.assertIn("- wgrad g (2 rows): XLA/new 0.707 (0.500 to 1.000)", text)
        self.assertLess(text.index("| 16172 | wgrad | g | n/a | n/a | 40.00 | n/a | 40.00 |"), text.index("| 16384 |"))
        self.assertIn("| H200 | 132 | 4096 -> 48 | FP32 | 16384 | wgrad | g | n/a | n/a | 40.00 | n/a | 80.00 |", text)


class WideGridAndXlaPathTest(parameterized.TestCase):
    def test_named_grids(self):
        self.assertEqual(harness.GRIDS["default"], (harness.GRID_D_OUT, (256,)))
        self.assertEqual(harness.GRID_D_OUT_WIDE, (96, 128, 192, 224, 256, 320, 384, 576, 1536))
        self.assertEqual(harness.GRID_EXPERTS_WIDE, (8, 16, 64, 128, 256, 384))
        self.assertEqual(set(harness.GRIDS["all"][0]), set(harness.GRID_D_OUT) | set(harness.GRID_D_OUT_WIDE))

    @parameterized.named_parameters(
        ("dense", ["--d_in=64", "--out_dtype=bfloat16"], "d_in -> d_out", harness.GRID_D_OUT_WIDE),
        ("router", ["--family=router", "--d_in=64"], "d -> E", harness.GRID_EXPERTS_WIDE),
    )
    def test_wide_grid_on_the_command_line(self, argv, column, widths):
        _, rows = run_cli(*argv, "--grid=wide", "--tokens=16", "--ops=fwd", "--arms=new", "--modes=g", "--groups=1")
        self.assertEqual(sorted(r[column] for r in rows), sorted(f"64 -> {w}" for w in widths))

    def test_xla_path_arm(self):
        spec = harness.parse_arm("xla/path")
        self.assertEqual((spec.kind, spec.path), ("xla", True))
        with self.assertRaises(ValueError):
            harness.parse_arm("xla/s4")

    def test_det_arm_times_the_kernels_under_an_xla_row(self):
        """det and split force their program, so a plan table's xla rows never replace the
        kernels they time; new follows the table; xla/path is jax_cake's XLA path."""
        from jax_cake.planner import tables

        point = harness.Point(16384, 4096, 96, "bfloat16")
        row = dict(op="fwd", d_in=4096, d_out=96, out="bfloat16", min_tokens=16384, max_tokens=16384, program="xla")
        table = tables.parse({"arch": "sm_90a", "sm_ranges": [{"min_sms": 132, "max_sms": 132, "rows": [row]}]})
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in harness.make_inputs(point, flush_mb=1)]
        calls = {}
        for arm in ("det", "new", "xla/path"):
            spec = harness.parse_arm(arm)
            with tables.use_table(table), faked_device(), harness.planning_for(spec):
                program = harness.steps_program(harness.op_fn("fwd", dense.project(spec)), 1)
                text = jax.jit(program).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            calls[arm] = re.findall(r"@(jax_cake_\w+)", text)
        self.assertEqual(calls, {"det": ["jax_cake_fwd"], "new": [], "xla/path": []})


if __name__ == "__main__":
    absltest.main()
