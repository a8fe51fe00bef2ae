"""benchmarks.tune on CPU: candidates, step filters, verdicts -> plan-table rows the planner reads."""

import subprocess
import sys

from absl.testing import absltest, parameterized

from benchmarks import harness as bench
from benchmarks import plan_rule, tune
import jax_cake as jc
from jax_cake.planner import variants
from jax_cake.planner import tables
from helpers import H200, REPO

SPLIT_A = {"program": "split", "tile": [64, 256, 64], "splits": 8, "reduction": "arrival"}
SPLIT_B = {"program": "split", "tile": [128, 256, 64], "splits": 4, "reduction": "arrival"}


def samples_for(point, arm, *, op=0.93, contention=1.01, steps=0.99, det_us=100.0, runs=2, groups=8, err=3e-6):
    """Samples as a tune child writes them: det and `arm` in every cell of the rule; the
    plain wgrad samples carry each arm's dw error (det's 2e-6, the arm's `err`)."""
    out = []

    def add(op_name, mode, run, ratio, tags=None):
        det = [det_us * (1 + 0.01 * g) for g in range(groups)]
        for name, times, rel_err in (("det", det, 2e-6), (arm, [d * ratio for d in det], err)):
            errors = {"rel_err": rel_err} if op_name == "wgrad" and not tags else {}
            out.append(
                {
                    **point.__dict__,
                    **(tags or {}),
                    "op": op_name,
                    "mode": mode,
                    "run": run,
                    "arm": name,
                    "groups_us": times,
                    **errors,
                }
            )

    for mode in plan_rule.MODES:
        for run in range(runs):
            add("wgrad", mode, run, op)
            for step_op in plan_rule.STEP_OPS:
                add(step_op, mode, run, steps)
            for sms in plan_rule.BUSY_SMS:
                for order in plan_rule.LAUNCH_ORDERS:
                    add("wgrad", mode, run, contention, {"busy_sms": sms, "order": order})
    return out


def dedupe_det(samples):
    """Two candidates' sample sets share det: keep one det sample per cell."""
    seen, out = set(), []
    for s in samples:
        key = (s["tokens"], s["op"], s["mode"], s["run"], s.get("busy_sms"), s.get("order"), s["arm"])
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def point(tokens, d_out=48):
    return bench.Point(tokens, 4096, d_out, "float32")


class CandidatesAndFiltersTest(absltest.TestCase):
    def test_candidates_are_the_compiled_arrival_tiles(self):
        tiles = sorted({v.tile for v in variants.VARIANTS if v.program == "wgrad" and v.store == "add"})
        self.assertNotEmpty(tiles)
        self.assertEqual(tune.candidate_arms(), ["split/t" + "x".join(map(str, t)) for t in tiles])
        m, n, k = tiles[0]
        self.assertEqual(tune.candidate_arms([4, 8])[:2], [f"split/s4/t{m}x{n}x{k}", f"split/s8/t{m}x{n}x{k}"])

    def test_busy_first_keeps_steps_inside_a_busy_kernel(self):
        keep = tune.keep_step("busy_first")
        self.assertTrue(keep((10, 20), [(0, 30)]))
        self.assertFalse(keep((10, 20), [(15, 30)]))
        self.assertFalse(keep((10, 20), []))

    def test_op_first_keeps_steps_during_which_the_busy_kernel_started(self):
        keep = tune.keep_step("op_first")
        self.assertTrue(keep((10, 20), [(15, 30)]))
        self.assertFalse(keep((10, 20), [(0, 30)]))
        self.assertFalse(keep((10, 20), [(20, 30)]))


class TableTest(parameterized.TestCase):
    def table_from(self, samples, plans, candidates):
        choices = tune.choose(samples, plans, candidates)
        table = tune.build_table("sm_90a", 132, "test", tune.table_rows(choices))
        return choices, table

    def planner_says(self, table, tokens, d_out=48):
        with tables.use_table(tables.parse(table)):
            return tables.verdict("sm_90a", 132, 4096, d_out, "float32", tokens).program

    def test_one_row_with_the_losing_token_count_excluded(self):
        arm = "split/t64x256x64"
        samples = (
            samples_for(point(16172), arm)
            + samples_for(point(16231), arm, steps=1.014)
            + samples_for(point(16384), arm)
        )
        plans = {point(t).label: {arm: SPLIT_A} for t in (16172, 16231, 16384)}
        choices, table = self.table_from(samples, plans, [arm])
        self.assertEqual([c.arm for c in choices], [arm, None, arm])
        self.assertIn("(c) bwd g r=1.0140", choices[1].evidence)
        (rng,) = table["sm_ranges"]
        (row,) = rng["rows"]
        self.assertEqual((rng["min_sms"], rng["max_sms"]), (132, 132))
        self.assertEqual((row["min_tokens"], row["max_tokens"], row["exclude_tokens"]), (16172, 16384, [16231]))
        self.assertEqual((row["tile"], row["splits"], row["reduction"]), ([64, 256, 64], 8, "arrival"))
        self.assertIn("T=16172 split: a: g run 0 p=0.0039 (8/8 wins) r=0.930", row["evidence"])
        self.assertIn("T=16231 det:", row["evidence"])
        self.assertEqual(
            [self.planner_says(table, t) for t in (16172, 16231, 16300, 16384, 16000)],
            ["split", "det", "split", "split", "det"],
        )
        self.assertEqual(self.planner_says(table, 16172, d_out=64), "det")

    @parameterized.named_parameters(
        ("op_loss", dict(op=0.995)),
        ("contention", dict(contention=1.031)),
        ("checkpointed_step", dict(steps=1.02)),
    )
    def test_no_row_when_every_token_count_fails(self, bad):
        arm = "split/t64x256x64"
        samples = samples_for(point(16172), arm, **bad) + samples_for(point(16384), arm, **bad)
        choices, table = self.table_from(samples, {}, [arm])
        self.assertEqual([c.arm for c in choices], [None, None])
        self.assertEqual(table["sm_ranges"][0]["rows"], [])
        self.assertEqual(self.planner_says(table, 16172), "det")

    def test_fastest_passing_candidate_wins(self):
        a, b = "split/t64x256x64", "split/t128x256x64"
        samples = dedupe_det(samples_for(point(16384), a, op=0.95) + samples_for(point(16384), b, op=0.90))
        plans = {point(16384).label: {a: SPLIT_A, b: SPLIT_B}}
        (choice,), table = self.table_from(samples, plans, [a, b])
        self.assertEqual(choice.arm, b)
        self.assertEqual(table["sm_ranges"][0]["rows"][0]["tile"], [128, 256, 64])

    def test_different_programs_get_one_row_per_token_count(self):
        a, b = "split/t64x256x64", "split/t128x256x64"
        samples = dedupe_det(
            samples_for(point(16172), a, op=0.90)
            + samples_for(point(16172), b, op=0.98)
            + samples_for(point(16384), a, op=0.98)
            + samples_for(point(16384), b, op=0.90)
        )
        plans = {point(t).label: {a: SPLIT_A, b: SPLIT_B} for t in (16172, 16384)}
        _, table = self.table_from(samples, plans, [a, b])
        rows = table["sm_ranges"][0]["rows"]
        self.assertEqual(
            [(r["min_tokens"], r["max_tokens"], r["tile"]) for r in rows],
            [(16172, 16172, [64, 256, 64]), (16384, 16384, [128, 256, 64])],
        )
        self.assertEqual(self.planner_says(table, 16231), "det")  # no claim between differing programs

    def test_screen_keeps_only_candidates_that_beat_det_in_graph_mode(self):
        a, b = "split/t64x256x64", "split/t128x256x64"
        screen = [
            s
            for s in dedupe_det(
                samples_for(point(16172), a, op=0.95, runs=1)
                + samples_for(point(16172), b, op=0.995, runs=1)
                + samples_for(point(16384), a, op=1.05, runs=1)
                + samples_for(point(16384), b, op=1.10, runs=1)
            )
            if s["op"] == "wgrad" and s["mode"] == "g" and "busy_sms" not in s
        ]
        survivors, screened = tune.screen_survivors(screen, [a, b])
        self.assertEqual(survivors, {point(16172): [a], point(16384): []})
        self.assertEqual(sorted(t for t, _ in ((p.tokens, c) for p, c in screened)), [16172, 16384, 16384])
        self.assertIn("r=0.995", screened[(point(16172), b)].detail)
        self.assertFalse(screened[(point(16384), a)].passed)

    def test_screened_points_stay_deterministic_and_say_why(self):
        a, b = "split/t64x256x64", "split/t128x256x64"
        screened = {
            (point(16384), a): plan_rule.Check("a", "g run 0", False, "p=1.0000 (0/8 wins) r=1.050"),
            (point(16384), b): plan_rule.Check("a", "g run 0", False, "p=1.0000 (0/8 wins) r=1.100"),
            (point(16172), b): plan_rule.Check("a", "g run 0", False, "p=0.3633 (4/8 wins) r=0.995"),
        }
        # The screen's survivor (a at 16172) was measured in full; b there and both at 16384 were not.
        samples = samples_for(point(16172), a)
        plans = {point(16172).label: {a: SPLIT_A}}
        choices = tune.choose(samples, plans, [a, b], screened)
        self.assertEqual([(c.point.tokens, c.arm) for c in choices], [(16172, a), (16384, None)])
        self.assertIn(f"{a} failed the screen (a) g run 0 p=1.0000 (0/8 wins) r=1.050", choices[1].evidence)
        self.assertIn(f"{b} failed the screen", choices[1].evidence)
        rows = tune.table_rows(choices)
        self.assertEqual([(r["min_tokens"], r["max_tokens"], r["tile"]) for r in rows], [(16172, 16172, [64, 256, 64])])

    def test_build_table_replaces_only_the_measured_sm_count(self):
        tile_row = {"program": "det", "op": "fwd", "tile": [128, 176, 64], "schedule": "pingpong", "cluster": [2, 1]}
        existing = {
            "arch": "sm_90a",
            "source": "old",
            "sm_ranges": [
                {"min_sms": 114, "max_sms": 114, "rows": [{"program": "xla", "row": "keep"}]},
                {"min_sms": 132, "max_sms": 132, "rows": [{"program": "xla", "row": "old"}, tile_row]},
            ],
        }
        table = tune.build_table("sm_90a", 132, "new", [{"program": "xla", "row": 1}], existing)
        self.assertEqual(table["source"], "new")
        # tune_tiles's rows stay, after the new ones: this tuner never measures tiles.
        self.assertEqual(
            [(r["min_sms"], r["rows"]) for r in table["sm_ranges"]],
            [(114, [{"program": "xla", "row": "keep"}]), (132, [{"program": "xla", "row": 1}, tile_row])],
        )


def xla_samples_for(op, pt, ratio, *, base="det", modes=plan_rule.MODES, runs=2, groups=8, first_run=0, err=4e-6):
    """Paired groups of `base` and XLA's dot (tune.XLA_ARM) at one cell, as a tune child
    writes them, with each arm's output error (base 2e-6, XLA `err`)."""
    out = []
    for mode in modes:
        for run in range(first_run, first_run + runs):
            det = [100.0 * (1 + 0.01 * g) for g in range(groups)]
            for name, times, rel_err in ((base, det, 2e-6), (tune.XLA_ARM, [d * ratio for d in det], err)):
                out.append(
                    {
                        **pt.__dict__,
                        "op": op,
                        "mode": mode,
                        "run": run,
                        "arm": name,
                        "groups_us": times,
                        "rel_err": rel_err,
                    }
                )
    return out


def bf16_point(tokens, d_out=96):
    return bench.Point(tokens, 4096, d_out, "bfloat16")


class XlaRowsTest(parameterized.TestCase):
    """XLA's dot as one more arm: verdicts -> xla rows -> what the planner reads."""

    def read(self, rows, op, tokens, out="bfloat16", d_out=96, deterministic=True):
        table = tables.parse(tune.build_table("sm_90a", 132, "test", rows))
        with tables.use_table(table):
            return tables.verdict(
                "sm_90a", 132, 4096, d_out, out, tokens, op=op, deterministic=deterministic
            ).program

    def test_cells_time_fwd_and_dgrad_once_per_shape_on_the_bf16_weight(self):
        points = bench.grid_points([16172, 16384], [4096], [96], ["float32", "bfloat16"])
        cells = tune.xla_cells(points)
        self.assertLen([c for c in cells if c[0] == "wgrad"], 4)
        for op in ("fwd", "dgrad"):
            self.assertEqual([p.out for o, p in cells if o == op], ["bfloat16", "bfloat16"])
        only_fp32 = tune.xla_cells(bench.grid_points([16384], [4096], [96], ["float32"]), ["fwd"])
        self.assertEqual([p.out for _, p in only_fp32], ["float32"])  # the row still says bfloat16

    @parameterized.parameters("fwd", "dgrad", "wgrad")
    def test_xla_row_where_xla_wins_in_every_run_of_both_modes(self, op):
        pts = [bf16_point(16172), bf16_point(16231), bf16_point(16384)]
        samples = (
            xla_samples_for(op, pts[0], 0.93)
            + xla_samples_for(op, pts[1], 0.995)  # under 1 % faster: not enough
            + xla_samples_for(op, pts[2], 0.95)
        )
        choices = tune.choose_xla(samples, [(op, p) for p in pts])
        self.assertEqual([c.beats_det for c in choices], [True, False, True])
        rows = tune.xla_table_rows(choices, "2026-12-02")
        # One row per measured winning T: XLA's speed depends on T's alignment, so a win
        # at 16172 and 16384 says nothing about 16300.
        self.assertEqual([(r["min_tokens"], r["max_tokens"]) for r in rows], [(16172, 16172), (16384, 16384)])
        row = rows[1]
        self.assertEqual((row["op"], row["program"], row["out"]), (op, "xla", "bfloat16"))
        self.assertEqual((row["ratio"], row["source"]), (0.95, "benchmarks.tune 2026-12-02"))
        self.assertIn("T=16172 xla: vs det a: g run 0 p=0.0039 (8/8 wins) r=0.930", rows[0]["evidence"])
        self.assertNotIn("b:", row["evidence"])  # (a) alone
        got = [self.read(rows, op, t, deterministic=d) for t in (16172, 16231, 16300, 16384) for d in (True, False)]
        self.assertEqual(got, ["xla"] * 2 + ["det"] * 4 + ["xla"] * 2)
        others = [o for o in tune.XLA_OPS if o != op]
        self.assertEqual({self.read(rows, o, 16384) for o in others}, {"det"})
        with tables.use_table(tables.parse(tune.build_table("sm_90a", 132, "test", rows))):
            p = jc.plan(op, tokens=16384, d_in=4096, d_out=96, out_dtype="bfloat16", device=H200)
        self.assertFalse(p.uses_kernel)
        self.assertIn("XLA's dot faster here (benchmarks.tune 2026-12-02: median time ratio 0.950)", p.reason)

    @parameterized.named_parameters(
        ("eager_loss", "e", 0, plan_rule.MODES),
        ("graph_loss", "g", 0, plan_rule.MODES),
        ("one_run_lost", "g", 1, plan_rule.MODES),
        ("no_eager_data", None, 0, ("g",)),
    )
    def test_no_row_unless_both_modes_and_every_run_pass(self, lose_mode, lose_run, modes):
        pt = bf16_point(16384)
        samples = []
        for mode in modes:
            for run in range(2):
                ratio = 1.02 if (mode, run) == (lose_mode, lose_run) else 0.90
                samples += xla_samples_for("wgrad", pt, ratio, modes=(mode,), runs=1, first_run=run)
        (choice,) = tune.choose_xla(samples, [("wgrad", pt)])
        self.assertFalse(choice.beats_det)
        self.assertEqual(tune.xla_table_rows([choice], "d"), [])

    def test_ties_are_no_wins(self):
        pt = bf16_point(16384)
        (choice,) = tune.choose_xla(xla_samples_for("fwd", pt, 1.0), [("fwd", pt)])
        self.assertFalse(choice.beats_det)
        self.assertIn("(0/8 wins)", choice.evidence())

    def test_fp32_and_bf16_wgrad_rows_are_apart(self):
        f32, b16 = bench.Point(16384, 4096, 96, "float32"), bf16_point(16384)
        samples = xla_samples_for("wgrad", f32, 0.9) + xla_samples_for("wgrad", b16, 1.05)
        choices = tune.choose_xla(samples, [("wgrad", f32), ("wgrad", b16)])
        rows = tune.xla_table_rows(choices, "d")
        self.assertEqual([(r["op"], r["out"]) for r in rows], [("wgrad", "float32")])
        self.assertEqual(self.read(rows, "wgrad", 16384, out="float32"), "xla")
        self.assertEqual(self.read(rows, "wgrad", 16384, out="bfloat16"), "det")

    @parameterized.named_parameters(
        ("xla_beats_split_too", 0.90, "xla", "xla"),
        ("xla_beats_det_only", 1.02, "split", "xla"),
    )
    def test_a_kept_split_program(self, xla_vs_split, det_false, det_true):
        """XLA against the split arm a wgrad point keeps: beating it too, XLA takes the
        point in both modes; beating only det, the split row comes first for
        deterministic=False and the xla row serves deterministic=True."""
        arm = "split/t64x256x64"
        pt = point(16384)
        full = samples_for(pt, arm)  # the full measurement keeps the split arm, and times XLA in its groups
        full += [
            {**s, "arm": tune.XLA_ARM, "groups_us": [g * xla_vs_split for g in s["groups_us"]]}
            for s in full
            if s["arm"] == arm and s["op"] == "wgrad" and "busy_sms" not in s
        ]
        choices = tune.choose(full, {pt.label: {arm: SPLIT_A}}, [arm])
        self.assertEqual(choices[0].arm, arm)
        xla = tune.choose_xla(xla_samples_for("wgrad", pt, 0.85), [("wgrad", pt)], choices, full)
        self.assertTrue(xla[0].beats_det)
        self.assertEqual(xla[0].beats_split, xla_vs_split < 0.99)
        rows = tune.table_rows(tune.yield_to_xla(choices, xla)) + tune.xla_table_rows(xla, "d")
        self.assertEqual(self.read(rows, "wgrad", 16384, out="float32", d_out=48, deterministic=False), det_false)
        self.assertEqual(self.read(rows, "wgrad", 16384, out="float32", d_out=48, deterministic=True), det_true)


class AccuracyContractTest(parameterized.TestCase):
    """A row replaces the kernel only where its arm's measured error meets the op's
    contract (plan_rule.rel_err_max); an arm faster in every run but over it is dropped,
    and the tuner records it with its error."""

    def read(self, table, op, tokens, out="float32", d_out=4096, deterministic=True):
        with tables.use_table(tables.parse(table)):
            return tables.verdict(
                "sm_90a", 132, 4096, d_out, out, tokens, op=op, deterministic=deterministic
            ).program

    def test_xla_faster_in_every_run_but_over_the_fp32_contract_gets_no_row(self):
        # The measured case: XLA's FP32-output dot at T 16384, 4096 -> 4096 beat det in
        # every run, and its dw was 1.86e-5 from float64 (the contract is 1e-5).
        pt = bench.Point(16384, 4096, 4096, "float32")
        samples = xla_samples_for("wgrad", pt, 0.927, err=1.86e-5)
        (x,) = tune.choose_xla(samples, [("wgrad", pt)])
        self.assertTrue(all(c.passed for c in x.verdict.checks if c.condition == "a"))  # faster in every run
        self.assertFalse(x.beats_det)
        self.assertEqual((x.rel_err, x.rel_err_max), (1.86e-5, 1e-5))
        self.assertEqual(tune.xla_table_rows([x], "d"), [])
        (dropped,) = tune.dropped_arms([], [x])
        self.assertEqual((dropped.op, dropped.arm, dropped.rel_err), ("wgrad", tune.XLA_ARM, 1.86e-5))
        self.assertIn("error 1.86e-05 misses the accuracy contract 1e-05", dropped.describe())
        self.assertIn("time ratio 0.927", dropped.describe())
        table = tune.build_table("sm_90a", 132, "test", [], dropped=[dropped.record("2026-12-02")])
        (rng,) = table["sm_ranges"]
        self.assertEqual(rng["rows"], [])
        (note,) = rng["dropped"]
        self.assertEqual(
            {k: note[k] for k in ("op", "d_in", "d_out", "out", "tokens", "program", "rel_err", "rel_err_max")},
            dict(op="wgrad", d_in=4096, d_out=4096, out="float32", tokens=16384, program="xla", rel_err=1.86e-5,
                 rel_err_max=1e-5),
        )
        self.assertIn("d: wgrad float32 err=1.86e-05 >= 1e-05 FAIL", note["evidence"])
        self.assertEqual(self.read(table, "wgrad", 16384), "det")  # the planner keeps the kernel

    def test_xla_faster_and_within_the_contract_gets_its_row(self):
        pt = bench.Point(16384, 4096, 4096, "float32")
        (x,) = tune.choose_xla(xla_samples_for("wgrad", pt, 0.927, err=6e-6), [("wgrad", pt)])
        self.assertTrue(x.beats_det)
        self.assertIsNone(x.dropped)
        (row,) = tune.xla_table_rows([x], "d")
        self.assertEqual((row["program"], row["rel_err"], row["rel_err_max"]), ("xla", 6e-6, 1e-5))
        self.assertIn("d: wgrad float32 err=6.00e-06 < 1e-05", row["evidence"])
        self.assertEqual(self.read(tune.build_table("sm_90a", 132, "t", [row]), "wgrad", 16384), "xla")

    def test_one_run_over_the_contract_is_enough_to_drop(self):
        pt = bench.Point(16384, 4096, 4096, "float32")
        samples = xla_samples_for("wgrad", pt, 0.9, runs=1, err=6e-6)
        samples += xla_samples_for("wgrad", pt, 0.9, runs=1, first_run=1, err=1.1e-5)
        (x,) = tune.choose_xla(samples, [("wgrad", pt)])
        self.assertFalse(x.beats_det)
        self.assertEqual(x.rel_err, 1.1e-5)

    def test_samples_without_errors_give_no_row(self):
        pt = bench.Point(16384, 4096, 4096, "float32")
        samples = [{k: v for k, v in s.items() if k != "rel_err"} for s in xla_samples_for("wgrad", pt, 0.9)]
        (x,) = tune.choose_xla(samples, [("wgrad", pt)])
        self.assertFalse(x.beats_det)
        self.assertIn("no error measured", x.evidence())
        self.assertEqual(tune.xla_table_rows([x], "d"), [])

    def test_bf16_outputs_have_the_bf16_contract(self):
        """XLA's fwd rounds once to BF16 as the kernel does: 2.3e-3 is within 1e-2, on the
        BF16 row key even where the cell was timed on an FP32 weight."""
        f32_point = bench.Point(16384, 4096, 192, "float32")
        (x,) = tune.choose_xla(xla_samples_for("fwd", f32_point, 0.6, err=2.3e-3), [("fwd", f32_point)])
        (row,) = tune.xla_table_rows([x], "d")
        self.assertEqual((row["op"], row["out"], row["rel_err"], row["rel_err_max"]), ("fwd", "bfloat16", 2.3e-3, 1e-2))
        (x,) = tune.choose_xla(xla_samples_for("fwd", f32_point, 0.6, err=1.5e-2), [("fwd", f32_point)])
        self.assertEqual((x.beats_det, x.dropped.rel_err_max), (False, 1e-2))

    def test_a_split_candidate_over_the_contract_is_dropped(self):
        a, b = "split/t64x256x64", "split/t128x256x64"
        pt = point(16384)
        samples = dedupe_det(samples_for(pt, a, op=0.85, err=2e-5) + samples_for(pt, b, op=0.95))
        plans = {pt.label: {a: SPLIT_A, b: SPLIT_B}}
        (choice,) = tune.choose(samples, plans, [a, b])
        self.assertEqual(choice.arm, b)  # a is faster but over 1e-5: the slower accurate one wins
        (dropped,) = choice.dropped
        self.assertEqual((dropped.arm, dropped.rel_err, dropped.ratio), (a, 2e-5, 0.85))
        self.assertEqual(dropped.record("d")["program"], "split")
        (only_a,) = tune.choose(samples_for(pt, a, op=0.85, err=2e-5), {pt.label: {a: SPLIT_A}}, [a])
        self.assertIsNone(only_a.arm)
        self.assertIn("(d) wgrad float32 err=2.00e-05 >= 1e-05", only_a.evidence)
        self.assertEqual(tune.table_rows([only_a]), [])
        self.assertEqual([d.arm for d in tune.dropped_arms([only_a], [])], [a])

    def test_keep_rows_keeps_the_notes_of_unmeasured_shapes(self):
        old = {"op": "wgrad", "d_in": 4096, "d_out": 1024, "out": "float32", "tokens": 16384, "program": "xla"}
        other = {**old, "d_out": 512}
        existing = {"arch": "sm_90a", "sm_ranges": [{"min_sms": 132, "max_sms": 132, "rows": [], "dropped": [old, other]}]}
        measured = {(tune.row_key(other), 16384)}
        table = tune.build_table("sm_90a", 132, "new", [], existing, measured, [{**other, "rel_err": 2e-5}])
        self.assertEqual(table["sm_ranges"][0]["dropped"], [old, {**other, "rel_err": 2e-5}])
        # The same shape measured at another T keeps the note of the T it was not run at.
        at_8192 = tune.build_table("sm_90a", 132, "new", [], existing, {(tune.row_key(old), 8192)})
        self.assertEqual(at_8192["sm_ranges"][0]["dropped"], [old, other])
        self.assertNotIn("dropped", tune.build_table("sm_90a", 132, "new", [], existing)["sm_ranges"][0])


class KeepRowsTest(absltest.TestCase):
    def test_rows_of_unmeasured_shapes_stay(self):
        old_xla = {"op": "fwd", "d_in": 4096, "d_out": 96, "out": "bfloat16", "program": "xla"}
        old_split = {"d_in": 5120, "d_out": 48, "out": "float32", "program": "split"}
        remeasured = {"op": "fwd", "d_in": 5120, "d_out": 96, "out": "bfloat16", "program": "xla"}
        rng = {"min_sms": 132, "max_sms": 132, "rows": [old_xla, old_split, remeasured]}
        existing = {"arch": "sm_90a", "sm_ranges": [rng]}
        measured = {(tune.row_key(remeasured), 8192), (tune.row_key(old_split), 16384)}
        table = tune.build_table("sm_90a", 132, "new", [{"new": 1}], existing, measured)
        self.assertEqual(table["sm_ranges"][0]["rows"], [old_xla, {"new": 1}])
        # A row of one token count stays when only another T of its shape is measured.
        at_16384 = {**remeasured, "min_tokens": 16384, "max_tokens": 16384}
        existing = {"arch": "sm_90a", "sm_ranges": [{**rng, "rows": [at_16384]}]}
        table = tune.build_table("sm_90a", 132, "new", [], existing, {(tune.row_key(remeasured), 8192)})
        self.assertEqual(table["sm_ranges"][0]["rows"], [at_16384])
        self.assertEqual(tune.build_table("sm_90a", 132, "new", [], existing)["sm_ranges"][0]["rows"], [])


class CommandLineTest(absltest.TestCase):
    def test_screened_run_on_cpu_prints_verdicts_and_writes_nothing(self):
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.tune", "--tokens=256", "--d_in=256", "--d_out=48"]
            + ["--out_dtype=float32", "--groups=3", "--steps=1", "--runs=1", "--timer=wall"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
        self.assertIn("(point, candidate) pairs passed (a) in graph mode", proc.stderr)
        self.assertIn("T=256 256->48 float32:", proc.stderr)
        # every arm's output error was measured beside its time: (d) ran on real numbers
        self.assertRegex(proc.stderr, r"wgrad T=256 256->48 float32: \S+ \(XLA/det worst run r=[\d.]+, XLA error \d")
        self.assertIn("d: wgrad float32 err=", proc.stderr)
        self.assertIn("no GPU: the verdicts above, but no plan table", proc.stderr)


if __name__ == "__main__":
    absltest.main()
