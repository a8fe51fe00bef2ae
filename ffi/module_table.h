// Shared by the FFI translation units: CUDA error text, and loading a generated table of
// exported CuTe DSL kernel modules (jax_cake_variants.inc, jax_cake_router_variants.inc).
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <string>

namespace jax_cake {

// "<call> failed: <error name> (<code>: <text>)", the text of every failed CUDA call.
inline std::string CudaErr(const std::string& call, cudaError_t err) {
  return call + " failed: " + cudaGetErrorName(err) + " (" + std::to_string(static_cast<int>(err)) + ": " +
         cudaGetErrorString(err) + ")";
}

// The load state of one table: loaded once, then the SM count the launches cap CTAs at.
struct ModuleTableState {
  std::mutex mutex;
  bool loaded = false;
  int num_sms = 132;
};

// Loads every entry's module (an entry has `name` and `cudaError_t load()`) on every
// visible device, gives the caller its device back and records its SM count.
// Idempotent; on failure returns false with the failing call in `error`.
template <typename Entry>
bool LoadModuleTable(const Entry* entries, int count, ModuleTableState* state, std::string* error) {
  std::lock_guard<std::mutex> lock(state->mutex);
  if (state->loaded) return true;
  int current = 0;
  cudaError_t err = cudaGetDevice(&current);
  if (err != cudaSuccess) {
    *error = CudaErr("cudaGetDevice", err);
    return false;
  }
  for (int i = 0; i < count; ++i) {
    err = entries[i].load();
    if (err != cudaSuccess) {
      *error = CudaErr(std::string("module load of ") + entries[i].name, err);
      const cudaError_t restore = cudaSetDevice(current);
      if (restore != cudaSuccess) *error += "; then " + CudaErr("cudaSetDevice", restore);
      return false;
    }
  }
  // The generated loaders walk all devices.
  err = cudaSetDevice(current);
  if (err != cudaSuccess) {
    *error = CudaErr("cudaSetDevice", err);
    return false;
  }
  int sms = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, current);
  if (err != cudaSuccess) {
    *error = CudaErr("cudaDeviceGetAttribute(MultiProcessorCount)", err);
    return false;
  }
  state->num_sms = sms;
  state->loaded = true;
  return true;
}

}  // namespace jax_cake
