#!/bin/bash
# The runs that need two GPUs or more, from a device bundle
# (scripts/device-bundle.sh), on every GPU the machine shows:
#
#   two GPUs (0 and 1): `xcall moe` as two launched processes (torchrun's
#     variables) over IPC and with NCCL forced (its network path, and
#     NVLink); one process driving both GPUs with NCCL forced and with
#     direct pairs; launched runs whose rank 1 is killed mid-step, on
#     NCCL's network path and over IPC (rank 0 must fail, naming what it
#     waited for, within --timeout); the NCCL and moe tests;
#     bench-cuda_shmem with NCCL on NVLink and on its network path.
#   four GPUs or more (all of them): one process driving every GPU; one
#     process per GPU under torchrun's, Open MPI's and Slurm's variables,
#     over IPC and with NCCL forced on its network path; two processes of
#     two GPUs each (direct pairs inside a process, IPC or NCCL between).
#   with four GPUs or more, the bundle's test binaries run on GPUs 2 and 3
#     beside the two-GPU set, then its permute bench.
#
# Each log goes to OUT as soon as its run ends, so a visit cut short keeps
# what ran; OUT/summary.txt has one line per run (exit status of each
# process, wall seconds, the verdict and step time of `xcall moe`).
#
# usage: scripts/multi-gpu-runs.sh BUNDLE_DIR OUT_DIR [PART]
# PART: two (the two-GPU set), faults (of the two-GPU set, only the killed
# ranks and the NCCL tests), tests (the bundle's tests on GPUs 2 and 3),
# all (the runs on every GPU), or both (the default: tests beside two,
# then all).
set -u
part=${3:-both}
bundle=$(cd "$1" && pwd)
mkdir -p "$2"
out=$(cd "$2" && pwd)
cd "$bundle"
export NCCL_NVLS_ENABLE=0 XCALL_BIN="$bundle/bin/xcall"
gpus=$(nvidia-smi -L | grep -c '^GPU ')
nvidia-smi topo -m >"$out/topo.txt" 2>&1
summary="$out/summary.txt"
echo "$(date -u +%FT%TZ) $gpus GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)" >"$summary"

# note NAME START_SECONDS RCS LOG...: one summary line for a finished run.
note() {
  local name=$1 start=$2 rcs=$3
  shift 3
  local log=$1 verdict step
  verdict=$(grep -h -m1 -E '^  verification|world: (PASS|FAIL)|error' "$@" 2>/dev/null | head -1 | sed 's/^ *//')
  step=$(grep -h -m1 '^  step time' "$log" 2>/dev/null | sed 's/^ *step time *//')
  echo "$name rc=[$rcs] $(($(date +%s) - start))s | $step | $verdict" >>"$summary"
}

# start NAME PORT PROCS VISIBLE STYLE [VAR=VALUE ...] -- [xcall moe flags]
# starts PROCS processes of `xcall moe --platform cuda` on the GPUs VISIBLE
# (CUDA_VISIBLE_DEVICES), each with the variables STYLE's launcher exports
# (torchrun, mpirun or srun), logs in OUT/NAME-RANK.txt; their pids go to
# `pids`.
start() {
  local name=$1 port=$2 procs=$3 visible=$4 style=$5
  shift 5
  local envs=() r rank_vars
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  pids=()
  for r in $(seq 0 $((procs - 1))); do
    case $style in
      torchrun) rank_vars="RANK=$r WORLD_SIZE=$procs LOCAL_RANK=$r LOCAL_WORLD_SIZE=$procs" ;;
      mpirun) rank_vars="OMPI_COMM_WORLD_RANK=$r OMPI_COMM_WORLD_SIZE=$procs OMPI_COMM_WORLD_LOCAL_RANK=$r OMPI_COMM_WORLD_LOCAL_SIZE=$procs" ;;
      srun) rank_vars="SLURM_PROCID=$r SLURM_NTASKS=$procs SLURM_LOCALID=$r" ;;
    esac
    # shellcheck disable=SC2086
    env CUDA_VISIBLE_DEVICES="$visible" "${envs[@]}" $rank_vars \
      MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
      timeout 150 bin/xcall moe --platform cuda "$@" >"$out/$name-$r.txt" 2>&1 &
    pids+=($!)
  done
}

# launch NAME PORT PROCS VISIBLE STYLE [VAR=VALUE ...] -- [xcall moe flags]:
# `start`'s processes (a 40 s --timeout), waited for and noted.
launch() {
  local name=$1 start_s p rcs=""
  start_s=$(date +%s)
  start "$@" --timeout 40s
  for p in "${pids[@]}"; do
    wait "$p"
    rcs="$rcs$? "
  done
  note "$name" "$start_s" "${rcs% }" "$out/$name-0.txt" "$out/$name"-*.txt
}

# spmt NAME VISIBLE [VAR=VALUE ...] -- [xcall moe flags]: one process, every
# GPU of VISIBLE a PE.
spmt() {
  local name=$1 visible=$2
  shift 2
  local envs=() start
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  start=$(date +%s)
  env CUDA_VISIBLE_DEVICES="$visible" "${envs[@]}" \
    timeout 150 bin/xcall moe --platform cuda --timeout 40s "$@" >"$out/$name.txt" 2>&1
  note "$name" "$start" "$?" "$out/$name.txt"
}

# binary NAME VISIBLE COMMAND...: a test or bench binary, its log and status.
binary() {
  local name=$1 visible=$2 start
  shift 2
  start=$(date +%s)
  env CUDA_VISIBLE_DEVICES="$visible" XCALL_REQUIRE_CUDA=1 timeout 200 "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  echo "rc=$rc" >>"$out/$name.txt"
  local line
  line=$(grep -h -E '^test result|^SKIP ' "$out/$name.txt" | sort | uniq -c | xargs)
  echo "$name rc=[$rc] $(($(date +%s) - start))s | $line" >>"$summary"
}

ds="--tokens 4096 --hidden 7168 --experts 256 --topk 8"
net="XCALL_SHMEM_TRANSPORT=nccl NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"

# killed NAME PORT [VAR=VALUE ...]: two launched processes on GPUs 0 and 1;
# once rank 0 reports timed steps (the step graph replaying), rank 1's
# xcall is killed (SIGKILL). Rank 0 must exit non-zero within --timeout
# (20 s) with an error that names what it waited for.
killed() {
  local name=$1 port=$2
  shift 2
  local start_s at waited=0 rcs
  start_s=$(date +%s)
  start "$name" "$port" 2 0,1 torchrun "$@" -- --timeout 20s --steps 1000000 --verify off
  # Killed once the timed steps (graph replays) run, at most 60 s in.
  until grep -q '(timed steps)' "$out/$name-0.txt" 2>/dev/null || [ $waited -ge 60 ]; do
    sleep 1
    waited=$((waited + 1))
  done
  sleep 2
  # The xcall under rank 1's timeout, not the timeout itself.
  pkill -9 -P "${pids[1]}"
  at=$(date +%s)
  wait "${pids[0]}"
  rcs="$? "
  echo "rank 0 exited $(($(date +%s) - at))s after rank 1 was killed" >>"$out/$name-0.txt"
  wait "${pids[1]}"
  rcs="$rcs$?"
  note "$name" "$start_s" "$rcs" "$out/$name-0.txt" "$out/$name-0.txt"
}

# The killed ranks and the NCCL tests on GPUs 0 and 1.
faults() {
  killed killed-nccl-net 29506 $net
  killed killed-ipc 29507 XCALL_SHMEM_TRANSPORT=auto
  binary cuda_nccl-2gpu 0,1 tests/xcall-shmem-cuda_nccl --test-threads=1
}

two_gpus() {
  launch nccl-net-default 29501 2 0,1 torchrun $net -- --steps 30
  launch nccl-net-dsv3 29502 2 0,1 torchrun $net -- $ds --steps 20
  launch nccl-nvlink-default 29503 2 0,1 torchrun XCALL_SHMEM_TRANSPORT=nccl -- --steps 30
  launch ipc-default 29504 2 0,1 torchrun XCALL_SHMEM_TRANSPORT=auto -- --steps 30
  launch ipc-dsv3 29505 2 0,1 torchrun XCALL_SHMEM_TRANSPORT=auto -- $ds --steps 20
  spmt spmt-nccl-default 0,1 XCALL_SHMEM_TRANSPORT=nccl -- --steps 30
  spmt spmt-direct-default 0,1 XCALL_SHMEM_TRANSPORT=auto -- --steps 30
  faults
  binary cuda_moe-2gpu 0,1 tests/xcall-cli-cuda_moe --test-threads=1
  binary bench-cuda_shmem-nvlink 0,1 benches/bench-cuda_shmem --bench
  binary bench-cuda_shmem-nccl-net 0,1 env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 \
    benches/bench-cuda_shmem --bench
}

# The bundle's test binaries on GPUs 2 and 3 (two of their own); then the
# permute bench on GPU 2 beside the async unpermute kernels' test under
# each compute-sanitizer tool on GPU 3.
bundle_tests() {
  local t tool
  for t in tests/*; do
    binary "test-$(basename "$t")" 2,3 "$t"
  done
  binary bench-cuda_permute 2 benches/bench-cuda_permute --bench &
  for tool in memcheck racecheck synccheck initcheck; do
    binary "$tool-async_unpermute" 3 compute-sanitizer --tool "$tool" --report-api-errors no \
      --error-exitcode 1 tests/xcall-permute-cuda_permute --exact \
      async_unpermute_kernels_equal_the_host --test-threads 1
  done
  wait
}

tests_pid=
if [ "$gpus" -ge 4 ] && { [ "$part" = tests ] || [ "$part" = both ]; }; then
  bundle_tests >"$out/bundle-tests.txt" 2>&1 &
  tests_pid=$!
fi
if [ "$gpus" -ge 2 ] && { [ "$part" = two ] || [ "$part" = both ]; }; then
  two_gpus
fi
if [ "$gpus" -ge 2 ] && [ "$part" = faults ]; then
  faults
fi
[ -n "$tests_pid" ] && wait "$tests_pid"
if [ "$gpus" -ge 4 ] && { [ "$part" = all ] || [ "$part" = both ]; }; then
  all=$(seq -s, 0 $((gpus - 1)))
  spmt spmt-direct-all-default "$all" XCALL_SHMEM_TRANSPORT=auto -- --steps 30 --verify sample:5
  spmt spmt-direct-all-dsv3 "$all" XCALL_SHMEM_TRANSPORT=auto -- $ds --steps 20 --verify sample:5
  launch ipc-all-dsv3 29511 "$gpus" "$all" torchrun XCALL_SHMEM_TRANSPORT=auto -- $ds --steps 20 --verify sample:5
  launch nccl-net-all-dsv3 29512 "$gpus" "$all" torchrun $net -- $ds --steps 20 --exchange copy --verify sample:5
  launch mpirun-all-default 29513 "$gpus" "$all" mpirun -- --steps 30 --verify sample:5
  launch srun-all-default 29514 "$gpus" "$all" srun -- --steps 30 --verify sample:5
  launch two-by-two-auto 29515 2 "$all" torchrun XCALL_SHMEM_TRANSPORT=auto -- $ds --steps 20 --verify sample:5
  launch two-by-two-nccl 29516 2 "$all" torchrun XCALL_SHMEM_TRANSPORT=nccl -- $ds --steps 20 --exchange copy --verify sample:5
fi
echo "done $(date -u +%FT%TZ)" >>"$summary"
