#!/usr/bin/env bash
# Checks the Bazel files with an offline Bazel 4.2.3 (Debian: apt-get install -y bazel-bootstrap).
#
#   .ci/check_bazel.sh          the target list and `bazel build //:jax_cake`
#   .ci/check_bazel.sh native   also both genrules (python -m jax_cake.build): needs an
#                               interpreter with jax + nvidia-cutlass-dsl (JAX_CAKE_PYTHON,
#                               else .venv/bin/python if present, else python3 on PATH,
#                               e.g. an activated venv) and nvcc + the CUDA toolkit
#
# The Bazel server is shut down on exit so no daemon outlives the CI step.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v bazel >/dev/null || { echo "bazel not found: apt-get install -y bazel-bootstrap" >&2; exit 1; }
trap 'bazel shutdown 2>/dev/null || true' EXIT

expected="//:aot_kernels //:jax_cake //:libjax_cake_ffi"
found=$(bazel query --noshow_progress //:all | sort | tr '\n' ' ')
[[ "${found% }" == "$expected" ]] || { echo "targets: got '$found', want '$expected'" >&2; exit 1; }

bazel build --noshow_progress //:jax_cake

if [[ "${1:-}" == native ]]; then
  if [[ -z "${JAX_CAKE_PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then JAX_CAKE_PYTHON=$PWD/.venv/bin/python; else JAX_CAKE_PYTHON=$(command -v python3); fi
  fi
  export JAX_CAKE_PYTHON
  bazel build --noshow_progress //:aot_kernels //:libjax_cake_ffi
  bin=$(bazel info bazel-bin 2>/dev/null)
  tar -tf "$bin/aot_kernels.tar" | grep 'jax_cake_variants.inc' >/dev/null  # no -q: an early exit would SIGPIPE tar
  nm -D --defined-only "$bin/libjax_cake_ffi.so" | grep -w JaxCakeWgrad >/dev/null
fi
echo "bazel check ok"
