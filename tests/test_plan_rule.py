"""The plan rule's decisions on synthetic timings and errors (no GPU, no jax)."""

from absl.testing import absltest, parameterized

from benchmarks import plan_rule as pr


def run(det, split):
    return pr.PairedRun(tuple(float(d) for d in det), tuple(float(s) for s in split))


def steady(det_us, ratio, n=10):
    """n paired groups, split = ratio * det every time, with small spread."""
    det = [det_us * (1 + 0.001 * i) for i in range(n)]
    return run(det, [d * ratio for d in det])


def winning_op(runs=3):
    return {m: [steady(100, 0.93) for _ in range(runs)] for m in pr.MODES}


def winning_contention():
    return {(s, o): [steady(100, 1.01)] for s in pr.BUSY_SMS for o in pr.LAUNCH_ORDERS}


def winning_steps():
    return {(op, m): [steady(200, 0.99)] for op in pr.STEP_OPS for m in pr.MODES}


ACCURATE = (3e-6, 4e-6)  # the split program's FP32 dw error in each run: within 1e-5


def decide(op, contention, steps, errors=ACCURATE, out="float32"):
    return pr.decide(op, contention, steps, errors=errors, out=out)


class SignTestTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("all_5_of_5", 5, 5, 1 / 32),
        ("all_4_of_4", 4, 4, 1 / 16),
        ("8_of_10", 8, 10, 56 / 1024),
        ("9_of_10", 9, 10, 11 / 1024),
        ("none", 0, 6, 1.0),
    )
    def test_exact_binomial_tail(self, wins, n, expected):
        self.assertAlmostEqual(pr.sign_test_p(wins, n), expected, places=12)

    def test_rejects_impossible_counts(self):
        with self.assertRaises(ValueError):
            pr.sign_test_p(6, 5)


class PairedRunTest(absltest.TestCase):
    def test_unpaired_lengths_are_rejected(self):
        with self.assertRaisesRegex(ValueError, "one split time per det time"):
            run([1, 2, 3], [1, 2])

    def test_nonpositive_times_are_rejected(self):
        with self.assertRaisesRegex(ValueError, "positive"):
            run([1, 0], [1, 1])


class DecideTest(parameterized.TestCase):
    def test_clear_win_keeps_split(self):
        v = decide(winning_op(), winning_contention(), winning_steps())
        self.assertTrue(v.keep_split, v.explain())
        self.assertEmpty(v.failed)
        self.assertEqual({c.condition for c in v.checks}, {"a", "b", "c", "d"})
        self.assertIn("split-K kept", v.explain())

    def test_a_loss_in_one_paired_run_fails_a(self):
        op = winning_op()
        op["g"][1] = steady(100, 1.02)
        v = decide(op, winning_contention(), winning_steps())
        self.assertFalse(v.keep_split)
        self.assertEqual([(c.condition, c.cell) for c in v.failed], [("a", "g run 1")])
        self.assertIn("(0/10 wins)", v.failed[0].detail)

    @parameterized.named_parameters(
        # 8 of 10 groups faster, each by 7 %: p = 56/1024 = 0.0547, just above 0.05.
        ("8_of_10_wins", [100] * 10, [93] * 8 + [101] * 2, "p=0.0547"),
        # Every one of 4 groups faster: p = 1/16 = 0.0625; 4 groups can never pass.
        ("4_of_4_wins", [100] * 4, [93] * 4, "p=0.0625"),
    )
    def test_p_just_above_005_fails(self, det, split, p_text):
        op = winning_op()
        op["e"] = [run(det, split)]
        v = decide(op, winning_contention(), winning_steps())
        self.assertFalse(v.keep_split)
        (failed,) = v.failed
        self.assertEqual((failed.condition, failed.cell), ("a", "e run 0"))
        self.assertIn(p_text, failed.detail)

    def test_9_of_10_wins_passes_the_sign_test(self):
        op = winning_op()
        op["e"] = [run([100] * 10, [93] * 9 + [101])]
        self.assertTrue(decide(op, winning_contention(), winning_steps()).keep_split)

    def test_median_ratio_0995_fails_even_with_all_wins(self):
        op = winning_op()
        op["g"] = [steady(100, 0.995)]
        v = decide(op, winning_contention(), winning_steps())
        self.assertFalse(v.keep_split)
        (failed,) = v.failed
        self.assertIn("(10/10 wins)", failed.detail)
        self.assertIn("r=0.995", failed.detail)

    def test_ties_count_against_split(self):
        # 5 wins and 5 ties: dropping ties would give p = 1/32 < 0.05 and a pass.
        op = winning_op()
        op["g"] = [run([100] * 10, [90] * 5 + [100] * 5)]
        v = decide(op, winning_contention(), winning_steps())
        self.assertFalse(v.keep_split)
        self.assertIn("(5/10 wins)", v.failed[0].detail)

    def test_eager_only_failure(self):
        op = winning_op()
        op["e"] = [steady(100, 0.93), steady(100, 1.0)]
        v = decide(op, winning_contention(), winning_steps())
        self.assertFalse(v.keep_split)
        self.assertEqual([c.cell for c in v.failed], ["e run 1"])
        self.assertTrue(all(c.passed for c in v.checks if c.cell.startswith("g")))

    def test_missing_mode_fails(self):
        op = winning_op()
        del op["e"]
        v = decide(op, winning_contention(), winning_steps())
        self.assertFalse(v.keep_split)
        self.assertEqual([(c.cell, c.detail) for c in v.failed], [("e", "no runs")])

    @parameterized.named_parameters(
        ("3_1_percent_op_first", 1.031, False),
        ("exactly_3_percent", 1.03, True),
        ("2_9_percent", 1.029, True),
    )
    def test_contention_limit_in_one_launch_order(self, ratio, keep):
        cont = winning_contention()
        cont[(16, "op_first")] = [steady(100, ratio)]
        v = decide(winning_op(), cont, winning_steps())
        self.assertEqual(v.keep_split, keep, v.explain())
        if not keep:
            self.assertEqual([(c.condition, c.cell) for c in v.failed], [("b", "16 SMs op_first")])

    def test_contention_needs_every_busy_sm_count_and_order(self):
        cont = winning_contention()
        del cont[(32, "busy_first")]
        v = decide(winning_op(), cont, winning_steps())
        self.assertEqual([c.cell for c in v.failed], ["32 SMs busy_first"])

    @parameterized.named_parameters(
        ("bwd_1_4_percent_graph", "bwd", "g", 1.014, False),
        ("step_1_4_percent_eager", "2fwd+bwd", "e", 1.014, False),
        ("bwd_1_2_percent", "bwd", "e", 1.012, True),
    )
    def test_step_limit(self, op_name, mode, ratio, keep):
        steps = winning_steps()
        steps[(op_name, mode)] = [steady(200, ratio)]
        v = decide(winning_op(), winning_contention(), steps)
        self.assertEqual(v.keep_split, keep, v.explain())
        if not keep:
            self.assertEqual([(c.condition, c.cell) for c in v.failed], [("c", f"{op_name} {mode}")])

    def test_step_ratio_is_of_medians_over_runs(self):
        # Per-run ratios 0.98, 0.98, 1.10: the median of run medians gives 0.98 -> pass,
        # a pooled mean would give about 1.02 -> fail.
        runs = [steady(200, 0.98), steady(200, 0.98), steady(200, 1.10)]
        self.assertAlmostEqual(pr.ratio_of_medians(runs), 0.98, places=6)
        steps = winning_steps()
        steps[("bwd", "g")] = runs
        self.assertTrue(decide(winning_op(), winning_contention(), steps).keep_split)

    def test_evidence_names_every_condition_and_the_failure(self):
        steps = winning_steps()
        steps[("bwd", "e")] = [steady(200, 1.014)]
        v = decide(winning_op(runs=1), winning_contention(), steps)
        text = v.evidence()
        self.assertRegex(text, r"^a: g run 0 p=0\.0010 \(10/10 wins\) r=0\.930, e run 0 .*; b: .*; c: .*; d: wgrad float32 err=4\.00e-06 < 1e-05$")
        self.assertIn("bwd e r=1.0140 FAIL", text)
        self.assertIn("deterministic program: failed (c) bwd e", v.explain())


class AccuracyTest(parameterized.TestCase):
    """(d): a candidate replaces the kernel only within the op's accuracy contract."""

    def test_the_contract(self):
        self.assertEqual(pr.rel_err_max("wgrad", "float32"), 1e-5)
        self.assertEqual({pr.rel_err_max(op, "bfloat16") for op in ("fwd", "dgrad", "wgrad")}, {1e-2})
        with self.assertRaisesRegex(ValueError, "no accuracy contract for fwd with float32"):
            pr.rel_err_max("fwd", "float32")  # fwd and dgrad write BF16 whatever w's dtype

    @parameterized.named_parameters(
        ("fp32_dw_within", "wgrad", "float32", [2e-6, 9.9e-6], True, "err=9.90e-06 < 1e-05"),
        ("fp32_dw_over_in_one_run", "wgrad", "float32", [5e-6, 1.86e-5], False, "err=1.86e-05 >= 1e-05"),
        ("exactly_the_contract", "wgrad", "float32", [1e-5], False, "err=1.00e-05 >= 1e-05"),
        ("bf16_y_within", "fwd", "bfloat16", [2.2e-3], True, "err=2.20e-03 < 1e-02"),
        ("bf16_dw_over", "wgrad", "bfloat16", [1.2e-2], False, "err=1.20e-02 >= 1e-02"),
        ("nan", "wgrad", "float32", [2e-6, float("nan")], False, "err=nan"),
        ("inf", "dgrad", "bfloat16", [float("inf")], False, "err=inf"),
        ("no_error_measured", "wgrad", "float32", [], False, "no error measured"),
        ("a_run_without_an_error", "wgrad", "float32", [2e-6, None], False, "no error measured"),
    )
    def test_check_accuracy(self, op, out, errors, passed, detail):
        check = pr.check_accuracy(op, out, errors)
        self.assertEqual((check.condition, check.cell, check.passed), ("d", f"{op} {out}", passed))
        self.assertIn(detail, check.detail)

    def test_a_faster_split_over_the_contract_stays_deterministic(self):
        v = decide(winning_op(), winning_contention(), winning_steps(), errors=(3e-6, 1.2e-5))
        self.assertFalse(v.keep_split)
        self.assertEqual([(c.condition, c.cell) for c in v.failed], [("d", "wgrad float32")])
        self.assertTrue(v.dropped_for_accuracy)
        self.assertIn("deterministic program: failed (d) wgrad float32", v.explain())

    def test_bf16_dw_has_the_bf16_contract(self):
        self.assertTrue(decide(winning_op(), winning_contention(), winning_steps(), (5e-3,), "bfloat16").keep_split)

    def test_a_timing_failure_is_no_accuracy_drop(self):
        op = winning_op()
        op["g"][0] = steady(100, 1.02)
        v = decide(op, winning_contention(), winning_steps(), errors=(2e-5,))
        self.assertFalse(v.keep_split or v.dropped_for_accuracy)

    @parameterized.named_parameters(
        # XLA's FP32-output dot at T 16384, 4096 -> 4096 on the H200: faster, 1.86e-5 off.
        ("fp32_dw_over", "wgrad", "float32", (1.86e-5, 1.86e-5), False),
        ("fp32_dw_within", "wgrad", "float32", (6e-6, 6e-6), True),
        ("bf16_y_within", "fwd", "bfloat16", (2.3e-3, 2.3e-3), True),
    )
    def test_xla_faster_in_every_run_needs_the_contract(self, gemm, out, errors, wins):
        v = pr.decide_xla(winning_op(), gemm=gemm, out=out, errors=errors)
        self.assertEqual(v.keep_split, wins, v.explain())
        self.assertEqual({c.condition for c in v.checks}, {"a", "d"})
        self.assertEqual(v.dropped_for_accuracy, not wins)
        self.assertIn(f"d: {gemm} {out} err=", v.evidence())


if __name__ == "__main__":
    absltest.main()
