#!/usr/bin/env bash
# Build libjtile_kernels.so for development and copy it next to jtile/kernels.py.
# Usage: kernels/dev_build.sh [extra cmake -D options]   (from anywhere)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cmake -S "$root/kernels" -B "$root/build/dev" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$root/build/dev"
# Replace by rename, never in place: overwriting a library that running
# processes have mapped crashes them.
cp "$root/build/dev/libjtile_kernels.so" "$root/jtile/libjtile_kernels.so.new.so"
mv -f "$root/jtile/libjtile_kernels.so.new.so" "$root/jtile/libjtile_kernels.so"
