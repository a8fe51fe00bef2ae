"""The data-movement floor of a projection's memory traffic, under the benchmark's L2 flush.

    python -m benchmarks.memory_floor --csv=benchmarks/data/memory_floor.csv   # the cases below
    python -m benchmarks.memory_floor --cases=16172:4096:48,524288:128:512

A case rows:a:b is the traffic of reading a bf16 [rows, a] array once and writing a bf16
[rows, b] array once, which is what the memory-bound projections move:
  fwd x[T, d_in] -> y[T, d_out] and the skinny wgrad (x read once, dw tiny): T:d_in:d_out;
  dgrad dy[T, d_out] -> dx[T, d_in]: T:d_out:d_in;
  batched fwd: (B*T):d_in:d_out.
For each case it times plain copy kernels (16-byte loads and stores, grid-stride, three
launch shapes; for b > a also kernels that stage chunks in shared memory, as a GEMM epilogue
does, and write them with bulk (TMA) stores or with the threads' 16-byte stores; the fastest
is reported, each on stderr) with the protocol's flush before every launch (XOR
over 128 MiB, as benchmarks/harness.py), CUDA events, median over launches. b > a: each row's
a values repeated along b; b <= a: the row read in full and b values written. These are
plain kernels, so a practical floor rather than a proof (a GEMM's TMA path can beat the
narrowest cases); the table says how far each memory-bound target and kernel is from what
the memory delivers under the same protocol (docs/benchmarks.md).

Needs a GPU and nvcc (the kernels are compiled at run time for the device's arch).
"""

from __future__ import annotations

import csv
import ctypes
import dataclasses
import datetime
import statistics
import sys
from typing import Sequence

import numpy as np
from absl import app, flags

from benchmarks import cuda_driver
from benchmarks import markdown as md

FLAGS = flags.FLAGS

# The grid's skinny x reads (T x d_in, d_out = 48), a skinny dgrad, and the batched family.
DEFAULT_CASES = (
    "16172:4096:48",
    "16231:4096:48",
    "16384:4096:48",
    "16172:5120:48",
    "16231:5120:48",
    "16384:5120:48",
    "16172:48:4096",
    "16172:48:5120",
    "524288:128:512",
    "524288:512:128",
    "65536:128:512",
    "65536:512:128",
)
LAUNCH_SHAPES = ((8, 256), (4, 512), (2, 1024))  # (CTAs per SM, threads): full occupancy each
# widen_bulk_RxS (rows per chunk, chunks in flight) and CTAs per SM: 160 KB or 2 x 80 KB of chunks at 128 -> 512.
BULK_LAUNCHES = ((32, 4, 1), (16, 8, 1), (64, 2, 1), (32, 2, 2), (16, 4, 2))
FLUSH_MIB = 128
POISON = 0xFFFFFFFF  # y before each launch
X_WORD = 0x3F803F81  # every 32-bit word of x (two bf16 near 1.0)

_SOURCE = r"""
#include <stdint.h>
// b > a: thread per x vector, its value stored at every a-th vector of the y row.
extern "C" __global__ void widen(const uint4* __restrict__ x, uint4* __restrict__ y, long long rows, int a, int b) {
  long long n = rows * a, stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
    uint4 v = __ldg(x + i);
    long long r = i / a;
    int c0 = (int)(i - r * a);
    uint4* row = y + r * b;
    for (int c = c0; c < b; c += a) row[c] = v;
  }
}
// b <= a: x read in full (four 16-byte loads in flight per thread), then y written.
extern "C" __global__ void narrow(const uint4* __restrict__ x, uint4* __restrict__ y, long long rows, int a, int b) {
  long long n = rows * a, stride = (long long)gridDim.x * blockDim.x;
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  unsigned acc = 0;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 p = __ldcs(x + i), q = __ldcs(x + i + stride), r = __ldcs(x + i + 2 * stride), s = __ldcs(x + i + 3 * stride);
    acc ^= p.x ^ p.y ^ p.z ^ p.w ^ q.x ^ q.y ^ q.z ^ q.w ^ r.x ^ r.y ^ r.z ^ r.w ^ s.x ^ s.y ^ s.z ^ s.w;
  }
  for (; i < n; i += stride) { uint4 p = __ldcs(x + i); acc ^= p.x ^ p.y ^ p.z ^ p.w; }
  long long m = rows * b;
  for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < m; j += stride) {
    unsigned v = acc ^ (unsigned)j;
    y[j] = make_uint4(v, v, v, v & 0x7fffffffu);  // never the all-ones poison
  }
}
// b > a through the bulk-copy (TMA) engine, as a GEMM epilogue writes: per chunk of ROWS rows,
// one bulk load of x into shared memory, the rows widened there by the threads, one bulk store
// of the chunk's y rows (contiguous in y). STAGES chunks in flight per CTA; persistent CTAs.
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void wait_parity(unsigned long long* bar, unsigned parity) {
  unsigned done = 0;
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
  }
}
// STG: the staged chunk leaves shared memory through the threads' 16-byte global stores
// instead of one bulk store (same loads, same staging: isolates the store path).
template <int ROWS, int STAGES, bool STG>
__device__ void widen_bulk(const uint4* __restrict__ x, uint4* __restrict__ y, long long rows, int a, int b) {
  extern __shared__ __align__(128) uint4 smem[];
  __shared__ __align__(8) unsigned long long bar[STAGES];
  uint4* xs = smem;
  uint4* ys = smem + STAGES * ROWS * a;
  long long chunks = (rows + ROWS - 1) / ROWS;
  int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < STAGES; s++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&bar[s])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (tid == 0) {
    for (int s = 0; s < STAGES; s++) {
      long long c = blockIdx.x + (long long)s * gridDim.x;
      if (c < chunks) {
        long long n = rows - c * ROWS < ROWS ? rows - c * ROWS : ROWS;
        bulk_load(xs + s * ROWS * a, x + c * ROWS * a, (unsigned)(n * a * 16), &bar[s]);
      }
    }
  }
  for (long long it = 0;; it++) {
    long long c = blockIdx.x + it * gridDim.x;
    if (c >= chunks) break;
    int s = (int)(it % STAGES);
    long long n = rows - c * ROWS < ROWS ? rows - c * ROWS : ROWS;
    wait_parity(&bar[s], (unsigned)((it / STAGES) & 1));
    if (!STG && tid == 0) asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(STAGES - 1) : "memory");  // ys[s] free
    __syncthreads();
    for (int i = tid; i < n * b; i += blockDim.x) ys[s * ROWS * b + i] = xs[s * ROWS * a + (i / b) * a + (i % b) % a];
    if (!STG) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the threads' writes, seen by the bulk engine
    __syncthreads();
    if (STG) {
      for (int i = tid; i < n * b; i += blockDim.x) y[c * ROWS * b + i] = ys[s * ROWS * b + i];
    }
    if (tid == 0) {
      if (!STG) {
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     :: "l"(y + c * ROWS * b), "r"(smem_addr(ys + s * ROWS * b)), "r"((unsigned)(n * b * 16)) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      }
      long long c2 = c + (long long)STAGES * gridDim.x;
      if (c2 < chunks) {
        long long n2 = rows - c2 * ROWS < ROWS ? rows - c2 * ROWS : ROWS;
        bulk_load(xs + s * ROWS * a, x + c2 * ROWS * a, (unsigned)(n2 * a * 16), &bar[s]);
      }
    }
  }
  if (!STG && tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
#define BULK(R, S) \
  extern "C" __global__ void __launch_bounds__(256) widen_bulk_##R##x##S( \
      const uint4* __restrict__ x, uint4* __restrict__ y, long long rows, int a, int b) { widen_bulk<R, S, false>(x, y, rows, a, b); } \
  extern "C" __global__ void __launch_bounds__(256) widen_staged_stg_##R##x##S( \
      const uint4* __restrict__ x, uint4* __restrict__ y, long long rows, int a, int b) { widen_bulk<R, S, true>(x, y, rows, a, b); }
BULK(32, 4)
BULK(16, 8)
BULK(64, 2)
BULK(32, 2)
BULK(16, 4)
// The protocol's L2 flush: XOR over the whole buffer (read + write).
extern "C" __global__ void flush_l2(uint4* __restrict__ buf, long long n) {
  long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
    uint4 v = buf[i];
    buf[i] = make_uint4(v.x ^ 1u, v.y ^ 1u, v.z ^ 1u, v.w ^ 1u);
  }
}
"""


@dataclasses.dataclass(frozen=True)
class Case:
    """Read bf16 [rows, a], write bf16 [rows, b]."""

    rows: int
    a: int
    b: int

    @classmethod
    def parse(cls, text: str) -> "Case":
        try:
            rows, a, b = (int(v) for v in text.split(":"))
        except ValueError:
            raise ValueError(f"--cases: expected rows:a:b (three integers), got {text!r}") from None
        if rows <= 0 or a <= 0 or b <= 0 or a % 8 or b % 8:
            raise ValueError(
                f"--cases: rows, a and b must be positive and a, b multiples of 8 (16 bytes), got {text!r}"
            )
        return cls(rows, a, b)

    @property
    def read_mb(self) -> float:
        return self.rows * self.a * 2 / 1e6

    @property
    def write_mb(self) -> float:
        return self.rows * self.b * 2 / 1e6

    @property
    def kernel(self) -> str:
        return "widen" if self.b > self.a else "narrow"


COLUMNS = ("rows", "a -> b (bf16)", "MB read", "MB written", "floor us", "TB/s", "fastest kernel, CTAs x threads")


def table_rows(results: Sequence[tuple[Case, float, str]]) -> list[list[str]]:
    return [
        [
            case.rows,
            f"{case.a} -> {case.b}",
            f"{case.read_mb:.1f}",
            f"{case.write_mb:.1f}",
            f"{us:.2f}",
            f"{(case.read_mb + case.write_mb) / us:.2f}",
            shape,
        ]
        for case, us, shape in results
    ]


def markdown(header: str, results: Sequence[tuple[Case, float, str]]) -> str:
    return "\n".join([header, "", *md.table(COLUMNS, table_rows(results))])


class FloorTimer:
    """Device buffers, the compiled kernels and the timing loop."""

    def __init__(self, launches: int):
        bulk = [f"{k}_{r}x{s}" for r, s, _ in BULK_LAUNCHES for k in ("widen_bulk", "widen_staged_stg")]
        self.driver = cuda_driver.Driver(_SOURCE, ["widen", "narrow", "flush_l2", *bulk])
        for name in bulk:  # each staged kernel may take all shared memory but its mbarriers' 1 KB
            self.bulk_smem_max = self.driver.use_all_shared_memory(name, static_bytes=1024)
        self.sms = self.driver.sm_count
        self.launches = launches
        self.flush_vectors = FLUSH_MIB * 2**20 // 16
        self.flush_buf = self.driver.alloc(FLUSH_MIB * 2**20)
        self.start, self.end = self.driver.event(), self.driver.event()

    def _flush(self) -> None:
        args = [self.flush_buf, ctypes.c_longlong(self.flush_vectors)]
        self.driver.launch("flush_l2", self.sms * 8, 256, args)

    def launches_for(self, case: Case) -> list[tuple[str, int, int, int]]:
        """(kernel, CTAs, threads, shared bytes) to try: the plain kernel at three occupancies,
        and for b > a the bulk-copy kernels where their chunks fit in shared memory."""
        out = [(case.kernel, self.sms * per_sm, threads, 0) for per_sm, threads in LAUNCH_SHAPES]
        if case.kernel == "widen":
            for rows, stages, per_sm in BULK_LAUNCHES:
                smem = stages * rows * (case.a + case.b) * 2
                if smem * per_sm <= self.bulk_smem_max:
                    for kernel in ("widen_bulk", "widen_staged_stg"):
                        out.append((f"{kernel}_{rows}x{stages}", self.sms * per_sm, 256, smem))
        return out

    def time(self, case: Case) -> tuple[float, str]:
        """(median us of the fastest launch, its description)."""
        d = self.driver
        x, y = d.alloc(case.rows * case.a * 2), d.alloc(case.rows * case.b * 2)
        try:
            d.memset32(x, X_WORD, case.rows * case.a // 2)
            best = None
            for kernel, ctas, threads, smem in self.launches_for(case):
                d.memset32(y, POISON, case.rows * case.b // 2)
                args = [x, y, ctypes.c_longlong(case.rows), ctypes.c_int(case.a // 8), ctypes.c_int(case.b // 8)]
                times = []
                for i in range(self.launches + 3):
                    self._flush()
                    d.record(self.start)
                    d.launch(kernel, ctas, threads, args, smem=smem)
                    d.record(self.end)
                    if i >= 3:
                        times.append(d.elapsed_us(self.start, self.end))
                self._check_written(case, kernel, y)
                us = statistics.median(times)
                print(f"  {case.rows}:{case.a}:{case.b} {kernel}, {ctas} x {threads}: {us:.2f} us", file=sys.stderr)
                if best is None or us < best[0]:
                    best = (us, f"{kernel}, {ctas} x {threads}")
            return best
        finally:
            d.synchronize()
            d.free(x)
            d.free(y)

    def _check_written(self, case: Case, kernel: str, y) -> None:
        """Every 16-byte vector of y written (no poison left); widen: every word is x's."""
        host = np.empty(case.rows * case.b // 2, np.uint32)
        self.driver.copy_to_host(host.ctypes.data, y, host.nbytes)
        if (host.reshape(-1, 4) == POISON).all(axis=1).any():  # a 16-byte vector still all poison
            raise RuntimeError(f"{case}: the {kernel} kernel left elements of y unwritten")
        if case.kernel == "widen" and not (host == X_WORD).all():
            raise RuntimeError(f"{case}: the {kernel} kernel wrote values that are not x's")


def main(argv):
    del argv
    try:
        cases = [Case.parse(c) for c in FLAGS.cases]
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    try:
        timer = FloorTimer(FLAGS.launches)
    except cuda_driver.NoDriverError as e:
        sys.exit(f"memory_floor needs an NVIDIA GPU and its driver: {e}")
    results = []
    for i, case in enumerate(cases, 1):
        us, shape = timer.time(case)
        results.append((case, us, shape))
        print(f"[{i}/{len(cases)}] {case.rows}:{case.a}:{case.b} {us:.2f} us", file=sys.stderr, flush=True)
    header = (
        f"GPU {timer.driver.name}, {timer.sms} SMs, memory floor under the protocol's flush "
        f"(XOR over {FLUSH_MIB} MiB), CUDA events, median of {FLAGS.launches} launches, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    )
    print(markdown(header, results))
    if FLAGS.csv:  # the table as the report reads it (benchmarks/report.py)
        with open(FLAGS.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(COLUMNS)
            writer.writerows(table_rows(results))


if __name__ == "__main__":
    flags.DEFINE_list("cases", list(DEFAULT_CASES), "rows:a:b cases (read bf16 [rows, a], write bf16 [rows, b]).")
    flags.DEFINE_integer("launches", 30, "Timed launches per launch shape (after 3 warm-up launches).")
    flags.DEFINE_string("csv", None, "Also write the table as CSV here (the report's input).")
    app.run(main)
