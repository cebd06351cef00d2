#!/bin/bash
# The runs that need two GPUs, from a device bundle (scripts/device-bundle.sh):
# `xcall moe` as two launched processes (torchrun's variables) over IPC and
# with NCCL forced (its network path, and NVLink), one process driving both
# GPUs with NCCL forced and with direct pairs, the NCCL and moe tests, and
# bench-cuda_shmem with NCCL on NVLink and on its network path. Each log goes
# to OUT as soon as its run ends, so a visit cut short keeps what ran.
#
# usage: scripts/two-gpu-runs.sh BUNDLE_DIR OUT_DIR
set -u
bundle=$(cd "$1" && pwd)
out=$2
mkdir -p "$out"
cd "$bundle"
export NCCL_NVLS_ENABLE=0 XCALL_BIN="$bundle/bin/xcall"
nvidia-smi topo -m > "$out/topo.txt" 2>&1
# launch NAME PORT [VAR=VALUE ...] -- [xcall moe flags]
launch() {
  local name=$1 port=$2
  shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  for r in 0 1; do
    env "${envs[@]}" RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 \
      MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      timeout 150 bin/xcall moe --platform cuda --timeout 40s "$@" > "$out/$name-$r.txt" 2>&1 &
  done
  wait
}
ds="--tokens 4096 --hidden 7168 --experts 256 --topk 8"
net="XCALL_SHMEM_TRANSPORT=nccl NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"
launch nccl-net-default 29501 $net -- --steps 30
launch nccl-net-dsv3 29502 $net -- $ds --steps 20
launch nccl-nvlink-default 29503 XCALL_SHMEM_TRANSPORT=nccl -- --steps 30
launch ipc-default 29504 XCALL_SHMEM_TRANSPORT=auto -- --steps 30
launch ipc-dsv3 29505 XCALL_SHMEM_TRANSPORT=auto -- $ds --steps 20
XCALL_SHMEM_TRANSPORT=nccl timeout 120 bin/xcall moe --platform cuda --timeout 40s --steps 30 \
  > "$out/spmt-nccl-default.txt" 2>&1
timeout 120 bin/xcall moe --platform cuda --timeout 40s --steps 30 > "$out/spmt-direct-default.txt" 2>&1
for t in xcall-shmem-cuda_nccl xcall-cli-cuda_moe; do
  XCALL_REQUIRE_CUDA=1 timeout 150 "tests/$t" --test-threads=1 > "$out/$t.txt" 2>&1
  echo "rc=$?" >> "$out/$t.txt"
done
timeout 150 benches/bench-cuda_shmem --bench > "$out/bench-cuda_shmem.txt" 2>&1
echo "rc=$?" >> "$out/bench-cuda_shmem.txt"
env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout 150 benches/bench-cuda_shmem --bench \
  > "$out/bench-cuda_shmem-nccl-net.txt" 2>&1
echo "rc=$?" >> "$out/bench-cuda_shmem-nccl-net.txt"
