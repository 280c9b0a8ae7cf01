#!/usr/bin/env bash
# `pip install -e .` into a fresh venv from a copy of the tracked files (so no
# stray libjtile_kernels.so sits in jtile/), then check that the kernels load
# from the editable install, both from outside the source tree and from its
# root (where `import jtile` finds the source package), and run the kernel
# tests from the root.
# Usage: .ci/editable_install.sh [python executable]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${1:-python}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git -C "$root" ls-files -z | (cd "$root" && tar cf - --null -T -) | tar xf - -C "$work" --one-top-level=src
"$python" -m venv "$work/venv"
venv_python="$work/venv/bin/python"
"$venv_python" -m pip install --quiet -e "$work/src[test]"

check='
import jtile, jtile.kernels as k
assert not k._UNAVAILABLE, k._UNAVAILABLE
print(f"  jtile.kernels from {k.__file__}, library from {k.LIBRARY_PATH}")
'
(cd "$work" && "$venv_python" -c "$check")
(cd "$work/src" && "$venv_python" -c "$check")
cd "$work/src"
tests=(tests/test_kernels.py)
[[ -f tests/test_kernels_conv_fast.py ]] && tests+=(tests/test_kernels_conv_fast.py)
"$venv_python" -m pytest "${tests[@]}" -q -p no:randomly
