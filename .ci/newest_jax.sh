#!/usr/bin/env bash
# The test suite under Python 3.12 with the newest jax pyproject allows (jax
# 0.11 and later need Python >= 3.12), in a venv of its own; installing jtile
# there compiles the kernels (against the oldest supported jaxlib's FFI
# headers, as every build does) and they must load under the newest jax. The
# whole default suite runs, not only the interpreter, tiling, kernel and ONNX
# tests: 13-19 min of tests, 16-26 min in all, on the 2-core image while other
# jobs loaded it.
# Usage: .ci/newest_jax.sh [extra pytest arguments]
# JTILE_PY312 may name the Python 3.12 interpreter; the default asks pyenv.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${JTILE_PY312:-$(PYENV_VERSION=3.12 pyenv which python3.12 2>/dev/null || command -v python3.12)}"
venv="$(mktemp -d)"
trap 'rm -rf "$venv"' EXIT
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade "$root[test]" jax jaxlib
"$venv/bin/python" - <<'PY'
import sys, jax, jaxlib, jtile.kernels as k
assert not k._UNAVAILABLE, k._UNAVAILABLE
print(f"python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}")
PY
cd "$root"
"$venv/bin/pytest" -q -p no:randomly "$@"
