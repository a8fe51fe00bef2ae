// Split-K reduce pass for the wgrad program (reduction = 1, ordered).
//
// ws  : fp32 partials [splits, count] (count = B * M * N, a multiple of 4)
// out : fp32 or bf16 [count]
// out[i] = ((ws[0][i] + ws[1][i]) + ws[2][i]) + ... in split order, one fp32 add
// chain per element, so the result is bitwise the same on every run.
//
// The same pass with splits = 1 converts the fp32 accumulation buffer of the
// arrival-order program (reduction = 2) to bf16.
//
// jax_cake_splitk_reduce_accumulate (gradient accumulation, jax_cake_wgrad_accumulate):
// acc[i] = acc[i] + (((ws[0][i] + ws[1][i]) + ...) in split order): the finished sum of
// the partials, then one fp32 add into the running sum. Bitwise reproducible.
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

__global__ void __launch_bounds__(256) SplitKReduceAccumulate(const float4* __restrict__ ws, float4* __restrict__ acc,
                                                              int64_t splits, int64_t count4) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count4; i += stride) {
    float4 sum = ws[i];
    for (int64_t s = 1; s < splits; ++s) {
      const float4 v = ws[s * count4 + i];
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    float4 a = acc[i];
    a.x += sum.x;
    a.y += sum.y;
    a.z += sum.z;
    a.w += sum.w;
    acc[i] = a;
  }
}

int64_t ReduceBlocks(int64_t count4, int num_sms) {
  const int64_t blocks = (count4 + 255) / 256;
  const int64_t max_blocks = static_cast<int64_t>(num_sms > 0 ? num_sms : 132) * 8;
  return blocks > max_blocks ? max_blocks : blocks;
}

}  // namespace

// acc (fp32 [count]) += the ordered sum of the partials; returns the launch error (no sync).
extern "C" cudaError_t jax_cake_splitk_reduce_accumulate(const float* ws, float* acc, int64_t splits, int64_t count,
                                                         int num_sms, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  if (count % 4 != 0 || splits < 1) return cudaErrorInvalidValue;
  const int64_t count4 = count / 4;
  SplitKReduceAccumulate<<<static_cast<unsigned>(ReduceBlocks(count4, num_sms)), 256, 0, stream>>>(
      reinterpret_cast<const float4*>(ws), reinterpret_cast<float4*>(acc), splits, count4);
  return cudaGetLastError();
}

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
