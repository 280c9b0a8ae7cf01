#!/usr/bin/env bash
# Build the kernels with AddressSanitizer into a temporary directory and run
# the kernel tests against that build (JTILE_KERNELS_LIB), with the ASan
# runtime preloaded into Python (with libstdc++, so that ASan's __cxa_throw
# interceptor finds the real one: jaxlib throws and catches C++ exceptions).
# Leak checking is off: CPython and XLA keep allocations alive until exit.
# Usage: .ci/asan_kernels.sh [extra pytest arguments]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
cmake -S "$root/kernels" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DJTILE_ASAN=ON >/dev/null
cmake --build "$build" >/dev/null
cd "$root"
tests=(tests/test_kernels.py)
[[ -f tests/test_kernels_conv_fast.py ]] && tests+=(tests/test_kernels_conv_fast.py)
[[ -f tests/test_kernels_numerics.py ]] && tests+=(tests/test_kernels_numerics.py)
[[ -f tests/test_kernels_nchwc.py ]] && tests+=(tests/test_kernels_nchwc.py)
[[ -f tests/test_kernels_expanded.py ]] && tests+=(tests/test_kernels_expanded.py)
[[ -f tests/test_plane_gathers.py ]] && tests+=(tests/test_plane_gathers.py)
JTILE_KERNELS_LIB="$build/libjtile_kernels.so" \
LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libstdc++.so)" \
ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1" \
  python -m pytest "${tests[@]}" -q -p no:randomly "$@"
