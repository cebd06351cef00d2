#!/usr/bin/env bash
# The expert-parallel figures of docs/BENCHMARKS.md ("Expert parallelism"
# and "From JAX and PyTorch"), on 1, 2 and 4 GPUs where the machine has
# them (GPUs 0 to N-1), in one run from a device bundle:
#
#   `xcall moe` (graph replays, every run checked with --verify sample:100):
#     the DeepSeek-V3-like shape (T=4096 H=7168 E=256 top-8) in bf16 and
#     FP8 dispatch, with one micro-batch and with two at --sms 48, 56 and
#     64 (two GPUs or more), and beside them the pushed dispatch
#     (--ep-kernels steps; the default pulls); the default shape (T=8192
#     H=4096 E=8 top-2);
#     decode (T=128, the DeepSeek-V3-like H, E, k); 300 steps of the
#     DeepSeek-V3-like bf16 step for the stability figures (its report's
#     tenths and p99);
#   bench-cuda_ep on all N GPUs: dispatch alone, GB/s received per GPU,
#     with every SM and with 24;
#   two GPUs or more: xcall.torch under torchrun (CUDA graph, and eager
#     dispatch / combine alone) and the JAX layer in one process
#     (python/bench_xcall_jax_ep.py --pallas-experts), with the wheel of
#     the bundle on PYTHONPATH;
#   2 and 4 PEs past the machine's GPUs: `xcall moe` as that many
#     processes under torchrun's variables, sharing the GPUs (they take
#     turns), --verify every over 6 steps: the DeepSeek-V3-like step in
#     bf16 and FP8 dispatch (two micro-batches) and decode, checked, not
#     timed (a summary line says "shared").
#
# Each run's printout goes to OUT/NAME.txt (and `xcall moe`'s report to
# OUT/NAME.json) as soon as it ends; OUT/summary.txt gets one line per run:
# its exit status, seconds, and its figure (the step's median, or the
# bench's lines). The exit status is 1 if any run failed.
#
# usage: scripts/ep-targets.sh BUNDLE_DIR OUT_DIR [MAX_GPUS]
set -u
bundle=$(cd "${1:?usage: ep-targets.sh BUNDLE_DIR OUT_DIR [MAX_GPUS]}" && pwd)
mkdir -p "${2:?usage: ep-targets.sh BUNDLE_DIR OUT_DIR [MAX_GPUS]}"
out=$(cd "$2" && pwd)
# Never NVLink SHARP: no multicast object on a shared host.
export NCCL_NVLS_ENABLE=0
xcall=$bundle/bin/xcall
py=${XCALL_PYTHON:-python3}
gpus=$(nvidia-smi -L | grep -c '^GPU ')
[ -n "${3:-}" ] && [ "$3" -lt "$gpus" ] && gpus=$3
summary=$out/summary.txt
echo "$(date -u +%FT%TZ) $gpus GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)" >"$summary"
nvidia-smi topo -m >"$out/topo.txt" 2>&1
dsv3="--tokens 4096 --hidden 7168 --experts 256 --topk 8"
fail=0

# moe NAME GPUS STEPS [flags]: `xcall moe` on GPUs 0 to GPUS-1.
moe() {
  local name=$1 g=$2 steps=$3 start=$SECONDS
  shift 3
  "$xcall" moe --platform cuda --devices "$(seq -s, 0 $((g - 1)))" --steps "$steps" \
    --verify sample:100 --json "$out/$name.json" "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && fail=1
  local step mism
  step=$(grep -m1 '^  step time' "$out/$name.txt" | sed 's/^ *step time *//')
  mism=$(grep -m1 -o '[0-9]* mismatching element' "$out/$name.txt")
  echo "$name rc=$rc $((SECONDS - start))s | $step | ${mism:-no verdict}" >>"$summary"
}

# other NAME CMD...: any other run; its figure lines are those with "ms".
other() {
  local name=$1 start=$SECONDS
  shift
  "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && fail=1
  echo "$name rc=$rc $((SECONDS - start))s" >>"$summary"
  grep -E ' ms' "$out/$name.txt" | sed 's/^/    /' >>"$summary"
}

# shared NAME PES [flags]: `xcall moe` as PES processes under torchrun's
# variables on this machine's fewer GPUs, sharing them: every output of 6
# steps checked; no figure, as the times are the turns'.
shared() {
  local name=$1 n=$2 start=$SECONDS rc=0 r port=$((29500 + RANDOM % 2000))
  local pids=()
  shift 2
  for r in $(seq 0 $((n - 1))); do
    # The first `gpus` GPUs only (MAX_GPUS), one PE a process.
    RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$port CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((gpus - 1)))" \
      timeout 300 "$xcall" moe --platform cuda --pes 1 --steps 6 --verify every \
      --json "$out/$name.json" "$@" >"$out/$name-r$r.txt" 2>&1 &
    pids+=($!)
  done
  for r in "${pids[@]}"; do wait "$r" || rc=1; done
  [ $rc -ne 0 ] && fail=1
  local mism
  mism=$(grep -m1 -o '[0-9]* mismatching element' "$out/$name-r0.txt")
  echo "$name rc=$rc $((SECONDS - start))s | shared: $n PEs on $gpus GPU(s), checked, not timed | ${mism:-no verdict}" >>"$summary"
}

for g in 2 4; do
  [ "$gpus" -ge 1 ] && [ "$g" -gt "$gpus" ] || continue
  for d in bf16 fp8; do
    # shellcheck disable=SC2086
    shared "shared-dsv3-$d-${g}pe-mb2" "$g" $dsv3 --dtype $d --microbatches 2 --sms 48
  done
  shared "shared-decode-${g}pe" "$g" --tokens 128 --hidden 7168 --experts 256 --topk 8
done

for g in 1 2 4; do
  [ "$g" -le "$gpus" ] || continue
  for d in bf16 fp8; do
    # shellcheck disable=SC2086
    moe "dsv3-$d-${g}gpu" "$g" 200 $dsv3 --dtype $d
    if [ "$g" -gt 1 ]; then
      # shellcheck disable=SC2086
      moe "dsv3-$d-${g}gpu-pushed" "$g" 200 $dsv3 --dtype $d --ep-kernels steps
      for sms in 48 56 64; do
        # shellcheck disable=SC2086
        moe "dsv3-$d-${g}gpu-mb2-sms$sms" "$g" 200 $dsv3 --dtype $d --microbatches 2 --sms $sms
      done
    fi
  done
  moe "default-bf16-${g}gpu" "$g" 200
  [ "$g" -gt 1 ] && moe "default-bf16-${g}gpu-mb2-sms48" "$g" 200 --microbatches 2 --sms 48
  moe "decode-${g}gpu" "$g" 300 --tokens 128 --hidden 7168 --experts 256 --topk 8
  # shellcheck disable=SC2086
  moe "dsv3-bf16-${g}gpu-300" "$g" 300 $dsv3
done

other "bench-cuda_ep-${gpus}gpu" env XCALL_EP_BENCH_GPUS="$gpus" XCALL_EP_BENCH_ONLY="$gpus" \
  XCALL_EP_BENCH_CASE=dsv3 "$bundle/benches/bench-cuda_ep" --bench

if [ "$gpus" -ge 2 ]; then
  site=$out/python-site
  rm -rf "$site"
  if "$py" -m pip install --quiet --disable-pip-version-check --no-deps --no-index \
    --target "$site" "$bundle"/python/xcall-*.whl >"$out/install-wheel.txt" 2>&1; then
    for g in 2 4; do
      [ "$g" -le "$gpus" ] || continue
      # The installed package finds its own library: no XCALL_LIB.
      with=(env -u XCALL_LIB CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((g - 1)))" PYTHONPATH="$site")
      other "torch-${g}gpu-graph" "${with[@]}" "$py" -m torch.distributed.run --standalone \
        --nproc-per-node "$g" "$bundle/python/bench_xcall_torch.py" --graph
      other "jax-${g}gpu" "${with[@]}" "$py" "$bundle/python/bench_xcall_jax_ep.py" \
        --platform gpu --pallas-experts
    done
  else
    fail=1
    echo "install-wheel failed: see install-wheel.txt" >>"$summary"
  fi
fi
exit $fail
