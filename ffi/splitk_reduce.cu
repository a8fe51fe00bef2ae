// Split-K reduce pass for the wgrad program (reduction = 1, ordered).
//
// ws  : fp32 partials [splits, count] (count = B * M * N, a multiple of 4)
// out : fp32 or bf16 [count]
// out[i] = ((ws[0][i] + ws[1][i]) + ws[2][i]) + ... in split order, one fp32 add
// chain per element, so the result is bitwise the same on every run.
//
// The same pass with splits = 1 converts the fp32 accumulation buffer of the
// arrival-order program (reduction = 2) to bf16.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

template <bool kBf16>
__global__ void __launch_bounds__(256) SplitKReduce(const float4* __restrict__ ws, void* __restrict__ out,
                                                    int64_t splits, int64_t count4) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count4; i += stride) {
    float4 acc = ws[i];
    for (int64_t s = 1; s < splits; ++s) {
      const float4 v = ws[s * count4 + i];
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    if constexpr (kBf16) {
      __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x, acc.y);
      __nv_bfloat162 hi = __floats2bfloat162_rn(acc.z, acc.w);
      uint2 packed;
      packed.x = *reinterpret_cast<uint32_t*>(&lo);
      packed.y = *reinterpret_cast<uint32_t*>(&hi);
      reinterpret_cast<uint2*>(out)[i] = packed;
    } else {
      reinterpret_cast<float4*>(out)[i] = acc;
    }
  }
}

}  // namespace

// Launches the reduce on `stream`; returns the launch error (no sync).
extern "C" cudaError_t jax_cake_splitk_reduce(const float* ws, void* out, int out_is_bf16, int64_t splits,
                                              int64_t count, int num_sms, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  if (count % 4 != 0 || splits < 1) return cudaErrorInvalidValue;
  const int64_t count4 = count / 4;
  const int threads = 256;
  int64_t blocks = (count4 + threads - 1) / threads;
  const int64_t max_blocks = static_cast<int64_t>(num_sms > 0 ? num_sms : 132) * 8;
  if (blocks > max_blocks) blocks = max_blocks;
  const float4* ws4 = reinterpret_cast<const float4*>(ws);
  if (out_is_bf16) {
    SplitKReduce<true><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(ws4, out, splits, count4);
  } else {
    SplitKReduce<false><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(ws4, out, splits, count4);
  }
  return cudaGetLastError();
}
