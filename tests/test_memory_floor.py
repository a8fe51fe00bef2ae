"""benchmarks.memory_floor on CPU: the cases it parses, the bytes it claims, its table, and a clear
exit where there is no GPU (the timing itself runs on the GPU machine)."""

import ctypes
import subprocess
import sys

from absl.testing import absltest
from helpers import REPO

from benchmarks import memory_floor


class CaseTest(absltest.TestCase):
    def test_batched_forward_traffic(self):
        case = memory_floor.Case.parse("524288:128:512")
        self.assertEqual((case.rows, case.a, case.b, case.kernel), (524288, 128, 512, "widen"))
        self.assertAlmostEqual(case.read_mb, 134.2, places=1)
        self.assertAlmostEqual(case.write_mb, 536.9, places=1)

    def test_skinny_read_narrows(self):
        self.assertEqual(memory_floor.Case.parse("16172:4096:48").kernel, "narrow")

    def test_bad_cases_name_the_flag(self):
        for text in ("16172:4096", "a:b:c", "16172:4096:50", "0:128:512"):
            with self.assertRaisesRegex(ValueError, "--cases"):
                memory_floor.Case.parse(text)

    def test_table_rates_are_bytes_over_time(self):
        case = memory_floor.Case(1000, 1000, 1000)  # 2 MB read + 2 MB written
        text = memory_floor.markdown("header", [(case, 1.0, "narrow, 264 x 1024")])
        self.assertIn("| 1000 | 1000 -> 1000 | 2.0 | 2.0 | 1.00 | 4.00 | narrow, 264 x 1024 |", text)

    def test_every_default_case_parses_to_its_sizes(self):
        for text in memory_floor.DEFAULT_CASES:
            case = memory_floor.Case.parse(text)
            self.assertEqual(f"{case.rows}:{case.a}:{case.b}", text)
            self.assertAlmostEqual(case.read_mb, case.rows * case.a * 2 / 1e6)


class NoGpuTest(absltest.TestCase):
    def test_exits_with_a_message_without_a_gpu(self):
        try:
            ctypes.CDLL("libcuda.so.1")
            self.skipTest("a CUDA driver is present: this checks the no-GPU path")
        except OSError:
            pass
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.memory_floor", "--cases=256:128:512"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("memory_floor needs an NVIDIA GPU", proc.stderr)


if __name__ == "__main__":
    absltest.main()
