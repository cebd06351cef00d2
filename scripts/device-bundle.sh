#!/usr/bin/env bash
# Builds, in release mode, every test binary of the workspace, every C test,
# every bench and the xcall command into target/device-bundle/, with a
# run-all.sh that runs them all (XCALL_REQUIRE_CUDA=1 unless told otherwise)
# and prints one summary line "N passed, N skipped, N failed" and its time.
#
# The bundle needs no Rust toolchain and no checkout where it runs: carry
# the folder to a GPU machine and run target/device-bundle/run-all.sh there
# (`--quick`: no Host benches and the permute grid's quick half, for a run
# of about 7 minutes on one GPU host, over 9 on two). The files of the source tree that
# tests compare against (docs, the report schema, the kept reports, the
# sources scanned for XCALL_* names) travel in source/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/device-bundle
rm -rf "$out"
mkdir -p "$out/tests" "$out/c_tests" "$out/benches" "$out/bin"

# Rust tests. Three need a toolchain, which the bundle does not carry: the
# header check (runs cbindgen), the C-test runner (the bundle compiles the
# C tests itself, below) and the JAX runner (run-all.sh runs python/tests
# itself).
skip_tests="xcall-ffi-header xcall-ffi-c_tests xcall-ffi-jax"
copy_executables() { # <json file> <dest> <kind>
  python3 - "$1" "$2" "$3" "$skip_tests" <<'PY'
import json, os, shutil, sys
src, dest, kind, skip = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split()
for line in open(src):
    msg = json.loads(line)
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
        continue
    if kind == "bench" and "bench" not in msg["target"]["kind"]:
        continue
    if kind == "test" and not msg["profile"]["test"]:
        continue
    package = os.path.basename(os.path.dirname(msg["manifest_path"]))
    name = f"{package}-{msg['target']['name']}"
    if kind == "bench":
        name = f"bench-{msg['target']['name']}"
    if name in skip:
        continue
    shutil.copy2(msg["executable"], os.path.join(dest, name))
    print(f"  {dest}/{name}")
PY
}
echo "building test binaries (release)"
cargo test --workspace --release --no-run --message-format=json >target/device-bundle-tests.json
copy_executables target/device-bundle-tests.json "$out/tests" test
echo "building benches (release)"
cargo bench --workspace --no-run --message-format=json >target/device-bundle-benches.json
copy_executables target/device-bundle-benches.json "$out/benches" bench
echo "building xcall and libxcall (release)"
cargo build --release --package xcall-cli --package xcall-ffi
cp target/release/xcall "$out/bin/xcall"
# The `xcall moe` figures of docs/BENCHMARKS.md: run by hand (needs 2 GPUs).
cp scripts/moe-matrix.sh "$out/moe-matrix.sh"

# The source files tests read (XCALL_SOURCE_ROOT points them here): the
# tracked and new files of these folders, a few MB.
echo "copying the source files tests read"
mkdir -p "$out/source"
git ls-files -z --cached --others --exclude-standard -- \
  docs include crates python scripts c_tests examples .ci |
  tar --null -T - -cf - | tar -xf - -C "$out/source"
echo "  $out/source/ ($(du -sh "$out/source" | cut -f1))"

# The C tests link the shared library the bundle carries (one copy of
# xcall instead of one per program keeps the bundle small); CI runs them
# against libxcall.a.
echo "building C tests against libxcall.so"
mkdir -p "$out/lib"
cp target/release/libxcall.so "$out/lib/"
# Programs record the soname (libxcall.so.<major>): give them that name.
soname=$(readelf -d target/release/libxcall.so | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
[ -n "$soname" ] && [ "$soname" != libxcall.so ] && ln -sf libxcall.so "$out/lib/$soname"
cc=${CC:-cc}
cxx=${CXX:-c++}
libs="-L$out/lib -lxcall -Wl,-rpath,\$ORIGIN/../lib -lpthread -ldl -lm -lrt"
for src in c_tests/test_*.c; do
  name=$(basename "$src" .c)
  $cc -std=c11 -Wall -Wextra -Werror -pedantic -Iinclude -Ic_tests "$src" $libs -o "$out/c_tests/$name"
  echo "  $out/c_tests/$name"
done
$cxx -std=c++17 -Wall -Wextra -Werror -Iinclude c_tests/header_cpp.cpp $libs -o "$out/c_tests/header_cpp"
echo "  $out/c_tests/header_cpp"

# The examples, against the same library; run-all.sh runs their CUDA half
# where CUDA is available.
rm -rf "$out/examples"
mkdir -p "$out/examples"
for src in examples/*.c; do
  name=$(basename "$src" .c)
  $cc -std=c11 -Wall -Wextra -Werror -pedantic -Iinclude "$src" $libs -o "$out/examples/$name"
done
$cxx -std=c++17 -Wall -Wextra -Werror -pedantic -Iinclude examples/raii.cpp $libs -o "$out/examples/raii"
echo "  $out/examples/"

# The JAX suite of the XLA FFI handlers, run against the xcall wheel
# (built here with $XCALL_PYTHON, which needs python/requirements-ci.txt's
# build tools) installed on the GPU machine beside its own jax.
rm -rf "$out/python"
mkdir -p "$out/python/tests"
wheel_py=${XCALL_PYTHON:-python3}
if ! "$wheel_py" -c "import build, auditwheel" 2>/dev/null; then
  echo "device-bundle: $wheel_py cannot import build and auditwheel (pip install -r python/requirements-ci.txt, or set XCALL_PYTHON)" >&2
  exit 1
fi
scripts/python-wheel.sh "$wheel_py" "$out/python" >/dev/null
cp python/bench_*.py python/README.md "$out/python/"
cp python/tests/*.py "$out/python/tests/"
echo "  $out/python/ ($(basename "$out"/python/xcall-*.whl))"

# run-all.sh (scripts/bundle-run-all.sh; scripts/bundle-run-all-test.sh
# tests it on a bundle of stand-in programs).
cp scripts/bundle-run-all.sh "$out/run-all.sh"
chmod +x "$out/run-all.sh"
# Debug info would take the bundle past what travels to a GPU machine;
# symbols stay, so backtraces still name functions. source/ holds scripts,
# not programs.
find "$out" -path "$out/source" -prune -o -type f -perm -u+x ! -name '*.sh' \
  -exec strip --strip-debug {} +
du -sh "$out"
echo "bundle ready: $out/run-all.sh"
