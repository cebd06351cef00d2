#!/usr/bin/env bash
# The `xcall moe` figures of docs/BENCHMARKS.md: three shapes (the
# default, E=64 top-6, the DeepSeek-V3-like T=4096 H=7168 E=256 top-8),
# capacity and dropless, the fused and the copied exchange, on GPU 0 alone
# and on GPUs 0 and 1. Every run checks its outputs (`--verify sample:6`)
# and writes its report to OUT/moe-SHAPE-MODE-EXCHANGE-NGPU.json beside
# its printout; the exit status is 1 if any run failed.
#
#   moe-matrix.sh OUT [XCALL]     (XCALL: default bin/xcall beside this
#                                  script, as in the device bundle)
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: moe-matrix.sh OUT [XCALL]}
xcall=${2:-$here/bin/xcall}
mkdir -p "$out"
# Never NVLink SHARP: no multicast object on a shared host.
export NCCL_NVLS_ENABLE=0
nvidia-smi topo -m >"$out/topo.txt" 2>&1
declare -A shapes=(
  [default]=""
  [e64]="--experts 64 --topk 6 --hidden 4096 --tokens 8192"
  [dsv3]="--tokens 4096 --hidden 7168 --experts 256 --topk 8"
)
fail=0
for shape in default e64 dsv3; do
  for mode in capacity dropless; do
    m=""
    [ "$mode" = dropless ] && m="--dropless"
    for ex in fused copy; do
      for devices in 0 0,1; do
        g=$([ "$devices" = 0 ] && echo 1 || echo 2)
        name=moe-$shape-$mode-$ex-${g}gpu
        start=$SECONDS
        # shellcheck disable=SC2086
        "$xcall" moe --platform cuda --devices "$devices" ${shapes[$shape]} $m \
          --exchange "$ex" --steps 20 --verify sample:6 --json "$out/$name.json" \
          >"$out/$name.txt" 2>&1
        rc=$?
        [ $rc -ne 0 ] && fail=1
        echo "$name rc=$rc $((SECONDS - start))s"
      done
    done
  done
done
exit $fail
