#!/usr/bin/env bash
# Tests the device bundle's run-all.sh (scripts/bundle-run-all.sh) on a
# bundle of stand-in programs in a temporary folder: how skip lines count
# with and without XCALL_REQUIRE_CUDA and XCALL_REQUIRE_NCCL_ONE_SIDED,
# with and without torch, what --quick leaves out (the JAX passes' files
# with a real pytest where one is given), and the run's own
# time. Run by .ci/run.
set -euo pipefail
script="$(cd "$(dirname "$0")" && pwd)/bundle-run-all.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0

# A bundle whose programs pass, on a machine of `gpus` GPUs (default 2);
# `extra` is a test program's body.
bundle() { # <dir> <extra test body> [gpus]
  local b=$1
  mkdir -p "$b"/{tests,c_tests,examples,benches,bin,python}
  cp "$script" "$b/run-all.sh"
  printf '#!/bin/sh\necho "  cuda  available, %s device(s), driver supports CUDA 13.0"\n' "${3:-2}" >"$b/bin/xcall"
  printf '#!/bin/sh\nexit 0\n' >"$b/tests/xcall-core-passes"
  printf '#!/bin/sh\n%s\n' "$2" >"$b/tests/xcall-shmem-cuda_nccl"
  printf '#!/bin/sh\nexit 0\n' >"$b/c_tests/test_ok"
  for e in hello shmem_exchange raii graph_cache permute_round_trip ep_layer; do
    printf '#!/bin/sh\nexit 0\n' >"$b/examples/$e"
  done
  # Benches record the arguments and the grid variables they were given.
  printf '#!/bin/sh\necho "$* grid_quick=$XCALL_GRID_QUICK grid_json=$XCALL_GRID_JSON" >"$(dirname "$0")/../ran-$(basename "$0")"\n' \
    >"$b/benches/bench-cuda_permute_grid"
  cp "$b/benches/bench-cuda_permute_grid" "$b/benches/bench-core"
  cp "$b/benches/bench-cuda_permute_grid" "$b/benches/bench-cuda_permute_bound"
  touch "$b/python/xcall-0-py3-none-any.whl"
  # An interpreter with jax and pytest whose suites pass; each JAX pass
  # (pytest leaving the PyTorch files out) records the platforms it
  # asked for.
  printf '#!/bin/sh\ncase "$*" in *"-m pytest"*/python/tests) echo "platforms=$XCALL_JAX_PLATFORMS" >>"$(dirname "$0")/ran-pytest" ;; esac\nexit 0\n' >"$b/python3"
  chmod +x "$b"/run-all.sh "$b"/bin/* "$b"/tests/* "$b"/c_tests/* "$b"/examples/* "$b"/benches/* "$b/python3"
}

# Runs the bundle with `env...` and `args...`; sets $out and $rc.
run_bundle() { # <dir> <env assignments...> -- <args...>
  local b=$1
  shift
  local envs=()
  while [ "$1" != -- ]; do
    envs+=("$1")
    shift
  done
  shift
  rc=0
  out=$(env -u XCALL_REQUIRE_NCCL_ONE_SIDED -u XCALL_BENCH_ARGS -u XCALL_SANITIZERS \
    -u XCALL_BUNDLE_LOGS -u XCALL_SOURCE_ROOT -u XCALL_GRID_QUICK -u XCALL_GRID_JSON XCALL_PYTHON="$b/python3" "${envs[@]}" \
    "$b/run-all.sh" "$@" 2>&1) || rc=$?
}

expect() { # <what> <condition...>
  if ! "${@:2}"; then
    echo "FAIL: $1"
    echo "$out" | sed 's/^/    /'
    failures=$((failures + 1))
  else
    echo "ok: $1"
  fi
}
has() { grep -qF -- "$1" <<<"$out"; }

one_sided='echo "SKIP shmem nccl one-sided: NCCL 2.28.3 has no one-sided operations (2.29 and newer)" >&2'
two_gpus='echo "SKIP shmem two GPUs: this machine has 1 GPU" >&2'

b="$tmp/one-sided"
bundle "$b" "$one_sided"
run_bundle "$b" XCALL_REQUIRE_CUDA=1 --
expect "the one-sided skip is a skip under XCALL_REQUIRE_CUDA=1" test "$rc" = 0
expect "  counted as skipped" has "1 skipped, 0 failed"
expect "  with its reason" has "SKIP shmem nccl one-sided: NCCL 2.28.3"
expect "  the run's own time" has "run-all.sh took "
expect "  the Host bench runs without --quick" test -e "$b/ran-bench-core"
expect "  the PyTorch suite on CPU too" has "PASS torch-cpu"
expect "  the default bench settings" grep -q -- "--warm-up-time 0.5 --measurement-time 1" "$b/ran-bench-core"
expect "  the whole permute grid, its JSON among the logs" \
  grep -q -- "grid_quick= grid_json=$b/logs/permute-grid.json" "$b/ran-bench-cuda_permute_grid"

run_bundle "$b" XCALL_REQUIRE_CUDA=1 XCALL_REQUIRE_NCCL_ONE_SIDED=yes --
expect "XCALL_REQUIRE_NCCL_ONE_SIDED=yes makes it a failure" test "$rc" = 1
expect "  named" has "FAIL xcall-shmem-cuda_nccl (skipped with XCALL_REQUIRE_CUDA=1"

run_bundle "$b" XCALL_REQUIRE_CUDA=1 XCALL_REQUIRE_NCCL_ONE_SIDED=maybe --
expect "a malformed XCALL_REQUIRE_NCCL_ONE_SIDED is a usage error" test "$rc" = 2
expect "  naming the variable" has "XCALL_REQUIRE_NCCL_ONE_SIDED=maybe is not a boolean"

b="$tmp/two-gpus"
bundle "$b" "$one_sided; $two_gpus"
run_bundle "$b" XCALL_REQUIRE_CUDA=1 --
expect "any other skip still fails under XCALL_REQUIRE_CUDA=1" test "$rc" = 1
expect "  named" has "FAIL xcall-shmem-cuda_nccl (skipped with XCALL_REQUIRE_CUDA=1"
run_bundle "$b" XCALL_REQUIRE_CUDA=0 --
expect "and is a skip without it" test "$rc" = 0
expect "  counted" has "1 skipped, 0 failed"

needs_two='echo "SKIP cuda ep timeout: needs 2 GPU(s), this machine has 1" >&2'
# The harness writes "test X ... " and "ok" apart: a skip line between.
inside='printf "test x ... SKIP shmem cuda spmt: needs 2 GPUs, this machine has 1\nok\n"'
b="$tmp/inside"
bundle "$b" "$inside" 1
run_bundle "$b" XCALL_REQUIRE_CUDA=1 --
expect "a skip line inside the harness's line is read" has "    SKIP shmem cuda spmt: needs 2 GPUs, this machine has 1"
expect "  and counted as a skip" has "SKIP xcall-shmem-cuda_nccl ("
bundle "$b" "$inside" 2
run_bundle "$b" XCALL_REQUIRE_CUDA=1 --
expect "  which fails on a machine with the GPUs" has "FAIL xcall-shmem-cuda_nccl (skipped with XCALL_REQUIRE_CUDA=1"
b="$tmp/one-gpu"
bundle "$b" "$needs_two" 1
run_bundle "$b" XCALL_REQUIRE_CUDA=1 --
expect "a test that needs more GPUs than the machine has is a skip under XCALL_REQUIRE_CUDA=1" test "$rc" = 0
expect "  counted, with its reason" has "SKIP xcall-shmem-cuda_nccl ("
expect "  " has "    SKIP cuda ep timeout: needs 2 GPU(s), this machine has 1"
expect "  the machine's GPUs are named" has "this machine: 1 GPU(s)"
expect "  the PyTorch GPU suite runs on one GPU (its ranks share it)" has "PASS torch-gpu"
expect "  " has "0 failed"
run_bundle "$b" XCALL_REQUIRE_CUDA=1 XCALL_REQUIRE_GPUS=2 --
expect "XCALL_REQUIRE_GPUS=2 on a machine of 1 GPU fails" test "$rc" = 1
expect "  saying why" has "XCALL_REQUIRE_GPUS=2 but this machine has 1 GPU(s)"
run_bundle "$b" XCALL_REQUIRE_CUDA=1 XCALL_REQUIRE_GPUS=two --
expect "a malformed XCALL_REQUIRE_GPUS is a usage error" test "$rc" = 2
b="$tmp/two-gpus-skipped"
bundle "$b" "$needs_two" 2
run_bundle "$b" XCALL_REQUIRE_CUDA=1 --
expect "the same skip on a machine that has the GPUs fails" test "$rc" = 1
expect "  named" has "FAIL xcall-shmem-cuda_nccl (skipped with XCALL_REQUIRE_CUDA=1"

b="$tmp/quick"
bundle "$b" "exit 0"
run_bundle "$b" XCALL_REQUIRE_CUDA=1 -- --quick
expect "--quick passes" test "$rc" = 0
expect "  runs no PyTorch suite on CPU, and says so" has "SKIP torch-cpu: the PyTorch suite on CPU processes (--quick)"
expect "  but runs it on GPUs" has "PASS torch-gpu"
expect "  runs no Host bench" test ! -e "$b/ran-bench-core"
expect "  and says so" has "SKIP bench-core: a Host bench (--quick)"
expect "  runs no permute bound analysis" test ! -e "$b/ran-bench-cuda_permute_bound"
expect "  runs the GPU benches, the permute grid's quick half" grep -q -- "grid_quick=1" "$b/ran-bench-cuda_permute_grid"
expect "  its time line says --quick" has "(--quick)"
expect "  runs the JAX suite's GPU cases alone in both passes (CI runs the CPU ones)" \
  test "$(grep -c '^platforms=gpu$' "$b/ran-pytest")" = 2
b="$tmp/full"
bundle "$b" "exit 0"
run_bundle "$b" XCALL_REQUIRE_CUDA=1 --
expect "without --quick the JAX suite's first pass runs its CPU and GPU cases" \
  test "$(sed -n 1p "$b/ran-pytest")" = "platforms=cpu,gpu"
expect "  and its second the GPU cases" test "$(sed -n 2p "$b/ran-pytest")" = "platforms=gpu"
rm "$b/ran-pytest"
run_bundle "$b" XCALL_REQUIRE_CUDA=0 --
expect "a GPU that is seen but not required runs the same passes" \
  test "$(tr '\n' ' ' <"$b/ran-pytest")" = "platforms=cpu,gpu platforms=gpu "
b="$tmp/no-gpu"
bundle "$b" "exit 0"
printf '#!/bin/sh\necho "cuda  unavailable: no driver"\n' >"$b/bin/xcall"
run_bundle "$b" XCALL_REQUIRE_CUDA=0 --
expect "without a GPU the JAX suite's first pass runs its CPU cases" \
  test "$(cat "$b/ran-pytest")" = "platforms=cpu"
expect "  the second (command buffers, a GPU setting) is a skip, with its reason" \
  has "SKIP jax-command-buffers-on: command buffers are a GPU setting, and no GPU is here"
expect "  and the PyTorch GPU suite, with its reason" has "SKIP torch-gpu: this machine has no GPU"
run_bundle "$b" XCALL_REQUIRE_CUDA=1 -- --slow
expect "an unknown argument is a usage error" test "$rc" = 2


b="$tmp/no-torch"
bundle "$b" "exit 0"
# An interpreter that has jax but not torch.
printf '#!/bin/sh\ncase "$*" in *"import torch"*) exit 1 ;; esac\nexit 0\n' >"$b/python3"
run_bundle "$b" XCALL_REQUIRE_CUDA=1 --
expect "without torch the PyTorch suite is a skip" test "$rc" = 0
expect "  counted, with its reason" has "SKIP torch-suite: $b/python3 cannot import torch and pytest"
expect "  " has "1 skipped, 0 failed"

# The JAX passes leave files out with a real pytest, run from outside the
# bundle as on a GPU host: every file they must leave out fails if
# collected, so the run passes only if pytest left them out.
# XCALL_PYTEST_PYTHON: an interpreter with pytest (CI's pinned one); a
# run without one says so, and fails under XCALL_REQUIRE_JAX=1.
real_py=${XCALL_PYTEST_PYTHON:-python3}
if "$real_py" -c "import pytest" 2>/dev/null; then
  b="$tmp/real-pytest"
  bundle "$b" "exit 0"
  mkdir -p "$b/python/tests"
  for f in test_xcall_torch.py test_xcall_torch_gpu.py test_layer.py test_readme.py \
    test_xcall_jax_ep.py test_xcall_jax_ep_processes.py; do
    printf 'def test_left_out():\n    assert False, "%s ran"\n' "$f" >"$b/python/tests/$f"
  done
  printf 'def test_gpu_case():\n    pass\n' >"$b/python/tests/test_xcall_jax_gpu.py"
  # jax and pytest "import"; pip "installs"; torch does not import.
  printf '#!/bin/sh\ncase "$*" in *"-m pytest"*) exec "%s" "$@" ;; *"import torch"*) exit 1 ;; esac\nexit 0\n' \
    "$(command -v "$real_py")" >"$b/python3"
  run_bundle "$b" XCALL_REQUIRE_CUDA=1 -- --quick
  expect "a real pytest, --quick: the JAX passes leave out the PyTorch and CPU-only files" test "$rc" = 0
  expect "  and run the rest" test "$(grep -c '^PASS jax-command-buffers-o[nf]' <<<"$out")" = 2
elif [ "${XCALL_REQUIRE_JAX:-0}" = 1 ]; then
  echo "FAIL: $real_py cannot import pytest (XCALL_REQUIRE_JAX=1; set XCALL_PYTEST_PYTHON)"
  failures=$((failures + 1))
else
  echo "SKIP bundle-run-all-test real pytest: $real_py cannot import pytest (set XCALL_PYTEST_PYTHON)" >&2
fi

b="$tmp/failing"
bundle "$b" 'echo "assertion failed"; exit 101'
run_bundle "$b" XCALL_REQUIRE_CUDA=0 --
expect "a failing program fails the run" test "$rc" = 1
expect "  with its log's tail" has "    assertion failed"

if [ "$failures" -ne 0 ]; then
  echo "bundle-run-all-test: $failures check(s) failed"
  exit 1
fi
echo "bundle-run-all-test: every check passed"
