#!/usr/bin/env bash
# Runs every binary of the bundle and prints "N passed, N skipped, N
# failed", then the run's own time. A run whose log has a skip line (a
# test's "SKIP <test>: <why>" on stderr, pytest's "SKIPPED [n] ...") counts
# as skipped, not passed. Each line gives the run's seconds.
#   --quick: no PyTorch suite on CPU processes, no Host benches (the criterion benches, bench-* not named
#     bench-cuda_*; CI runs them), no permute bound analysis
#     (bench-cuda_permute_bound), the permute grid's quick half
#     (XCALL_GRID_QUICK=1: T = 4096 only) and, with a GPU required, the
#     JAX suite's GPU cases alone in both passes (CI runs its CPU cases
#     against the pinned and the newest JAX), for a run of about 7
#     minutes on one GPU host, over 9 on two (the GPU benches last).
#   XCALL_REQUIRE_CUDA (default 1): a missing GPU fails instead of skipping,
#     and any skipped run counts as failed, except two skips that count as
#     skips, with their reasons: a test that needs more GPUs than this
#     machine has ("needs N GPU..." with N above the count `xcall doctor`
#     reports; with N within it the skip fails), and the one-sided NCCL
#     tests' skip where the machine's NCCL runs no one-sided operations
#     (older than 2.29) unless XCALL_REQUIRE_NCCL_ONE_SIDED=1 (the test
#     then fails itself).
#   XCALL_REQUIRE_GPUS (default 1 with XCALL_REQUIRE_CUDA=1, else 0): the
#     run fails at once on a machine with fewer GPUs (set it to the
#     machine's count where the multi-GPU tests must run).
#   XCALL_SOURCE_ROOT (default <bundle>/source): the source files tests
#     compare against.
#   XCALL_BUNDLE_LOGS (default <bundle>/logs): one log per binary.
#   XCALL_SANITIZERS (e.g. "memcheck racecheck synccheck"): also run the GPU
#     test binaries (test files named cuda_*.rs) under compute-sanitizer with
#     each tool. API errors are not reported: negative tests provoke driver
#     errors on purpose and assert them themselves.
#   XCALL_BENCH_ARGS (default quick settings): arguments for the benches
#     (the criterion ones read them; the GPU benches run fixed rounds).
#   XCALL_GRID_JSON (default <logs>/permute-grid.json): where the permute
#     grid bench writes its measurements.
#   NCCL_NVLS_ENABLE is always 0 here: NCCL never creates NVLink SHARP
#   (multicast) objects, which can take a shared host's GPUs out of service.
#   The JAX suite (python/tests) runs when $XCALL_PYTHON (default python3)
#   imports jax and pytest, against the bundle's xcall wheel installed
#   into <logs>/python-site, twice: XLA command buffers off, then on
#   (custom calls recorded into XLA's command buffers: the second pass
#   runs only the GPU cases, and without a GPU it is a skip). With
#   XCALL_REQUIRE_CUDA=1 it must see a GPU; the counters the GPU tests saw
#   go to <logs>/jax-report.jsonl.
#   The PyTorch suite (python/tests/test_xcall_torch*.py; the JAX suite
#   leaves it out) runs when $XCALL_PYTHON imports torch and pytest, against
#   the wheel installed into <logs>/python-site-torch: on CPU (processes of
#   Host PEs), then on GPUs (torchrun, a process per rank, 2 ranks, 4 and
#   one per GPU, rank r on GPU r mod the GPUs, so ranks share GPUs where
#   there are fewer; no GPU is a skip). Without torch it is a skip.
set -u
start=$SECONDS
here=$(cd "$(dirname "$0")" && pwd)
quick=0
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    -h | --help)
      sed -n '2,/^set -u/p' "$0" | sed '$d'
      exit 0
      ;;
    *)
      echo "run-all.sh: unknown argument $arg (--quick or --help)" >&2
      exit 2
      ;;
  esac
done
# A boolean as xcall spells it (docs/ENVIRONMENT.md), printed as 1 or 0.
flag() { # <name> <value>
  case "$(printf '%s' "$2" | tr '[:upper:]' '[:lower:]' | tr -d ' ')" in
    1 | true | yes | on) echo 1 ;;
    0 | false | no | off | '') echo 0 ;;
    *)
      echo "$1=$2 is not a boolean: 1, 0, true, false, yes, no, on or off" >&2
      return 2
      ;;
  esac
}
XCALL_REQUIRE_CUDA=$(flag XCALL_REQUIRE_CUDA "${XCALL_REQUIRE_CUDA:-1}") || exit 2
export XCALL_REQUIRE_CUDA
require_one_sided=$(flag XCALL_REQUIRE_NCCL_ONE_SIDED "${XCALL_REQUIRE_NCCL_ONE_SIDED:-}") || exit 2
require_gpus=${XCALL_REQUIRE_GPUS:-$XCALL_REQUIRE_CUDA}
case "$require_gpus" in
  '' | *[!0-9]*)
    echo "XCALL_REQUIRE_GPUS=$require_gpus is not a count of GPUs" >&2
    exit 2
    ;;
esac
export NCCL_NVLS_ENABLE=0
export XCALL_BIN="$here/bin/xcall"
export XCALL_SOURCE_ROOT=${XCALL_SOURCE_ROOT:-$here/source}
logs=${XCALL_BUNDLE_LOGS:-$here/logs}
bench_args=${XCALL_BENCH_ARGS:---warm-up-time 0.5 --measurement-time 1 --noplot}
export XCALL_GRID_JSON=${XCALL_GRID_JSON:-$logs/permute-grid.json}
[ "$quick" = 1 ] && export XCALL_GRID_QUICK=${XCALL_GRID_QUICK:-1}
# Skip lines that stay skips under XCALL_REQUIRE_CUDA=1: the one-sided NCCL
# tests where the machine's NCCL runs no one-sided operations (their own
# variable, XCALL_REQUIRE_NCCL_ONE_SIDED=1, makes that a failure).
optional_skip='^SKIP shmem nccl one-sided( processes)?: '
[ "$require_one_sided" = 1 ] && optional_skip='^$'
mkdir -p "$logs"
passed=0
skipped=0
failed=0
run() { # <name> <command...>
  local name=$1 t0=$SECONDS skips required
  shift
  if "$@" >"$logs/$name.log" 2>&1; then
    # A test's skip line can land inside the harness's "test X ... ok"
    # (it writes the name and the result apart): "SKIP <test>: " counts
    # wherever it starts, from "SKIP " on.
    skips=$(grep -oE '(^SKIPPED \[.*|SKIP [^:]*: .*)' "$logs/$name.log")
    if [ -n "$skips" ]; then
      required=$(printf '%s\n' "$skips" | grep -Ev "$optional_skip" | wants_more_gpus)
      if [ "$XCALL_REQUIRE_CUDA" = 1 ] && [ -n "$required" ]; then
        failed=$((failed + 1))
        echo "FAIL $name (skipped with XCALL_REQUIRE_CUDA=1, $((SECONDS - t0)) s)"
      else
        skipped=$((skipped + 1))
        echo "SKIP $name ($((SECONDS - t0)) s)"
      fi
      printf '%s\n' "$skips" | sed 's/^/    /'
    else
      passed=$((passed + 1))
      echo "PASS $name ($((SECONDS - t0)) s)"
    fi
  else
    failed=$((failed + 1))
    echo "FAIL $name ($((SECONDS - t0)) s, log: $logs/$name.log)"
    tail -n 30 "$logs/$name.log" | sed 's/^/    /'
  fi
}
# The GPUs `xcall doctor` sees ("cuda  available, N device(s)"), 0 without.
gpus=$("$here/bin/xcall" doctor 2>/dev/null | sed -n 's/^ *cuda  available, \([0-9][0-9]*\) device.*/\1/p')
gpus=${gpus:-0}
# Whether this run has a GPU: required, or seen.
gpu=0
if [ "$XCALL_REQUIRE_CUDA" = 1 ] || [ "$gpus" -gt 0 ]; then
  gpu=1
fi
# Drops the skip lines of tests that need more GPUs than this machine has.
wants_more_gpus() {
  local line n
  while IFS= read -r line; do
    n=$(printf '%s\n' "$line" | sed -n 's/.*needs \([0-9][0-9]*\) GPU.*/\1/p')
    [ -n "$n" ] && [ "$n" -gt "$gpus" ] && continue
    printf '%s\n' "$line"
  done
}
doctor() {
  "$here/bin/xcall" doctor || return 1
  if [ "$XCALL_REQUIRE_CUDA" = 1 ]; then
    "$here/bin/xcall" doctor | grep -q "cuda  available" || { echo "CUDA required but not available"; return 1; }
  fi
  if [ "$gpus" -lt "$require_gpus" ]; then
    echo "XCALL_REQUIRE_GPUS=$require_gpus but this machine has $gpus GPU(s)"
    return 1
  fi
}
run doctor doctor
echo "this machine: $gpus GPU(s)"
for t in "$here"/tests/*; do run "$(basename "$t")" "$t"; done
for c in "$here"/c_tests/*; do run "$(basename "$c")" "$c"; done
run example-hello "$here/examples/hello"
run example-shmem_exchange "$here/examples/shmem_exchange"
run example-raii "$here/examples/raii"
for e in graph_cache permute_round_trip ep_layer; do
  run "example-$e-host" "$here/examples/$e" host
  if [ "$gpu" = 1 ]; then
    run "example-$e-cuda" "$here/examples/$e" cuda
  else
    skipped=$((skipped + 1))
    echo "SKIP example-$e-cuda: no CUDA here"
  fi
done
for tool in ${XCALL_SANITIZERS:-}; do
  for t in "$here"/tests/*-cuda_*; do
    run "$tool-$(basename "$t")" compute-sanitizer --tool "$tool" --report-api-errors no \
      --error-exitcode 1 "$t" --test-threads 1
  done
done
jax_suite() { # <on|off>
  # The globs name the folder: pytest 9 matches a glob without one only
  # under its rootdir, and the suite runs from outside the bundle.
  local flags="--xla_gpu_enable_command_buffer=" only_gpu=() tests="$here/python/tests"
  local platforms=cpu
  [ "$gpu" = 1 ] && platforms=cpu,gpu
  [ "$1" = on ] && flags="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
  # Command buffers are a GPU setting: the second pass runs the GPU cases
  # alone (the CPU ones ran in the first pass, and these flags change
  # nothing for them); so does the first with --quick and a GPU required.
  if [ "$1" = on ] || { [ "$XCALL_REQUIRE_CUDA" = 1 ] && [ "$quick" = 1 ]; }; then
    platforms=gpu
    only_gpu=(--ignore-glob="$tests/test_layer.py" --ignore-glob="$tests/test_readme.py"
      --ignore-glob="$tests/test_xcall_jax_ep.py" --ignore-glob="$tests/test_xcall_jax_ep_processes.py")
  fi
  XLA_FLAGS="$flags" XCALL_XLA_COMMAND_BUFFERS=$1 PYTHONPATH="$site" XCALL_TEST_INSTALLED=1 \
    XCALL_JAX_PLATFORMS=$platforms XCALL_JAX_REPORT="$logs/jax-report.jsonl" \
    env -u XCALL_LIB "$py" -m pytest -q -rs -p no:cacheprovider \
    --ignore-glob="$tests/test_xcall_torch*" "${only_gpu[@]}" "$tests"
  local rc=$?
  [ $rc -eq 5 ] && echo "pytest collected no tests"
  return $rc
}
py=${XCALL_PYTHON:-python3}
# The wheel goes into a folder of its own, on PYTHONPATH beside the
# interpreter's jax: the suite tests the installed package.
site="$logs/python-site"
if "$py" -c "import jax, pytest" 2>/dev/null; then
  rm -rf "$site" "$logs/jax-report.jsonl"
  run install-wheel "$py" -m pip install --quiet --disable-pip-version-check --no-deps \
    --no-index --target "$site" "$here"/python/xcall-*.whl
  run jax-command-buffers-off jax_suite off
  if [ "$gpu" = 1 ]; then
    run jax-command-buffers-on jax_suite on
  else
    skipped=$((skipped + 1))
    echo "SKIP jax-command-buffers-on: command buffers are a GPU setting, and no GPU is here"
  fi
elif [ "$XCALL_REQUIRE_CUDA" = 1 ]; then
  run jax-suite sh -c "echo '$py cannot import jax and pytest'; exit 1"
else
  skipped=$((skipped + 1))
  echo "SKIP jax-suite: $py cannot import jax and pytest"
fi
torch_suite() { # <test file>
  PYTHONPATH="$tsite" XCALL_TEST_INSTALLED=1 env -u XCALL_LIB "$py" -m pytest -q -rs \
    -p no:cacheprovider "$here/python/tests/$1"
  local rc=$?
  [ $rc -eq 5 ] && echo "pytest collected no tests"
  return $rc
}
tsite="$logs/python-site-torch"
if "$py" -c "import torch, pytest" 2>/dev/null; then
  rm -rf "$tsite"
  run install-wheel-torch "$py" -m pip install --quiet --disable-pip-version-check --no-deps \
    --no-index --target "$tsite" "$here"/python/xcall-*.whl
  if [ "$quick" = 1 ]; then
    skipped=$((skipped + 1))
    echo "SKIP torch-cpu: the PyTorch suite on CPU processes (--quick)"
  else
    run torch-cpu torch_suite test_xcall_torch.py
  fi
  if [ "$gpus" -lt 1 ]; then
    # The suite skips as a whole (pytest then collects no test). With
    # fewer GPUs than ranks, its ranks share the GPUs.
    skipped=$((skipped + 1))
    echo "SKIP torch-gpu: this machine has no GPU"
  else
    run torch-gpu torch_suite test_xcall_torch_gpu.py
  fi
else
  skipped=$((skipped + 1))
  echo "SKIP torch-suite: $py cannot import torch and pytest"
fi
for b in "$here"/benches/*; do
  case "$(basename "$b")" in
    bench-cuda_permute_bound)
      # The bound analysis (about 70 s on an H200) is no test of the build.
      if [ "$quick" = 1 ]; then
        skipped=$((skipped + 1))
        echo "SKIP $(basename "$b"): the permute bound analysis (--quick)"
        continue
      fi
      ;;
    bench-cuda_*) ;;
    *)
      if [ "$quick" = 1 ]; then
        skipped=$((skipped + 1))
        echo "SKIP $(basename "$b"): a Host bench (--quick)"
        continue
      fi
      ;;
  esac
  # shellcheck disable=SC2086
  run "$(basename "$b")" "$b" --bench $bench_args
done
echo "$passed passed, $skipped skipped, $failed failed"
echo "run-all.sh took $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s$([ "$quick" = 1 ] && echo ' (--quick)')"
[ "$failed" -eq 0 ]
