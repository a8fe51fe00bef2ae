"""jax_cake.tools.tune on CPU: candidates, step filters, verdicts -> plan-table rows the planner reads."""

import subprocess
import sys

from absl.testing import absltest, parameterized

from jax_cake.tools import bench, plan_rule, tune
from jax_cake.planner import variants
from jax_cake.planner import tables

SPLIT_A = {"program": "split", "tile": [64, 256, 64], "splits": 8, "reduction": "arrival"}
SPLIT_B = {"program": "split", "tile": [128, 256, 64], "splits": 4, "reduction": "arrival"}


def samples_for(point, arm, *, op=0.93, contention=1.01, steps=0.99, det_us=100.0, runs=2, groups=8):
    """Samples as a tune child writes them: det and `arm` in every cell of the rule."""
    out = []

    def add(op_name, mode, run, ratio, tags=None):
        det = [det_us * (1 + 0.01 * g) for g in range(groups)]
        for name, times in (("det", det), (arm, [d * ratio for d in det])):
            out.append(
                {
                    **point.__dict__,
                    **(tags or {}),
                    "op": op_name,
                    "mode": mode,
                    "run": run,
                    "arm": name,
                    "groups_us": times,
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
        existing = {
            "arch": "sm_90a",
            "source": "old",
            "sm_ranges": [
                {"min_sms": 114, "max_sms": 114, "rows": ["keep"]},
                {"min_sms": 132, "max_sms": 132, "rows": ["old"]},
            ],
        }
        table = tune.build_table("sm_90a", 132, "new", [{"row": 1}], existing)
        self.assertEqual(table["source"], "new")
        self.assertEqual(
            [(r["min_sms"], r["rows"]) for r in table["sm_ranges"]], [(114, ["keep"]), (132, [{"row": 1}])]
        )


class CommandLineTest(absltest.TestCase):
    def test_screened_run_on_cpu_prints_verdicts_and_writes_nothing(self):
        proc = subprocess.run(
            [sys.executable, "-m", "jax_cake.tools.tune", "--tokens=256", "--d_in=256", "--d_out=48"]
            + ["--out_dtype=float32", "--groups=3", "--steps=1", "--runs=1", "--timer=wall"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
        self.assertIn("(point, candidate) pairs passed (a) in graph mode", proc.stderr)
        self.assertIn("T=256 256->48 float32:", proc.stderr)
        self.assertIn("no GPU: the verdicts above, but no plan table", proc.stderr)


if __name__ == "__main__":
    absltest.main()
