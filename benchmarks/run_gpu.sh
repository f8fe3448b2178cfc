#!/usr/bin/env bash
# The GPU runs, one mode per call of the lent machine (each fits in its 10-minute limit). Results land in $OUT;
# copy them into benchmarks/results/ (set SLIDE_COMMIT: the device's copy has no .git).
#   bash benchmarks/run_gpu.sh small   # GPU tests, then B1 and B3 (the plain GPU-resident peer in the same run)
#   bash benchmarks/run_gpu.sh final   # every package's GPU tests, the fused loss vs Liger, B3 and B1 with the peer
#   bash benchmarks/run_gpu.sh b8      # B8 without and with clipping (no peer: it does not fit this host)
#   bash benchmarks/run_gpu.sh clip    # B3 and B8 with clipping: split vs whole updates, device share 0.5 vs 1/3
#   bash benchmarks/run_gpu.sh check   # every package's GPU tests, B8 with clipping, the loss's matmul ceiling and
#                                      # the loss vs Liger, B8 without clipping
#   bash benchmarks/run_gpu.sh host    # host memory bandwidth alone and under PCIe copies; B3 (peer; clipped and
#                                      # not) and B1 (peer)
#   bash benchmarks/run_gpu.sh states  # slide-kernels' whole test suite (its CUDA-only tests too), B8 with clipping
#                                      # and bf16 AdamW states
#   bash benchmarks/run_gpu.sh threads # the host's CPUs; B3 (peer) with torch's threads at 16, 15, 14, 12 and a
#                                      # smaller host AdamW block; the optimizer beside a busy thread (one tarball)
#   bash benchmarks/run_gpu.sh land    # memory, scheduler and train GPU tests; lane_probe.py; B3 (peer); B8 clipped
#   bash benchmarks/run_gpu.sh buffers # clipped B3 and B8, each with 2 and 3 device-update buffers
#   bash benchmarks/run_gpu.sh carveout # scheduler GPU tests; lane_probe.py with the GEMMs leaving SMs free (the
#                                      # engine runs with a carveout of 2026-11-30 need commit 23a826f's switch)
#   bash benchmarks/run_gpu.sh verify  # memory, scheduler and train GPU tests; clipped B3 (peer) twice and clipped B8
#                                      # twice, each in a process of its own (runs vary by up to 5%)
#   bash benchmarks/run_gpu.sh balance # clipped B3 with 3 device-update buffers, device share 0.4, both; clipped
#                                      # B8 with 3 buffers, and 3 buffers at share 0.55 (one tarball)
#   bash benchmarks/run_gpu.sh window  # memory, scheduler and train GPU tests; clipped B3 (peer) with 2 and 3 slots,
#                                      # twice each, alternating; clipped B8 with 2 and 3 slots (tarred run by run)
#   bash benchmarks/run_gpu.sh share   # scheduler and train GPU tests; clipped B3 (peer); clipped B8 with device
#                                      # share 0.5, 0.5625 and 0.625; B3 without clipping (tarred run by run)
#   bash benchmarks/run_gpu.sh compare # memory, scheduler and train GPU tests; clipped B3 (peer) and B8, each
#                                      # with this checkout's slide-scheduler and with a base one, alternating,
#                                      # B3 twice (about 9 minutes). Before:
#                                      # `mkdir -p .cmp && git archive BASE packages/slide-scheduler/src | tar x -C
#                                      # .cmp` (.cmp is git-ignored), and carry .cmp in the call
#   bash benchmarks/run_gpu.sh sweep   # clipped B3 (peer) and B8 at device share 0.5, 0.5625 and 0.625 (B8's
#                                      # 0.625 before its 0.5625, B3's last)
#   bash benchmarks/run_gpu.sh handoff # the params part's handoff to the device three ways (host_memory.py
#                                      # --handoff), the host's memory settings; clipped B8 with this checkout's
#                                      # slide-scheduler and a base one (.cmp, as for compare), twice, alternating
#   bash benchmarks/run_gpu.sh tail    # train GPU tests; the tail on the tokens with a target only (tail.py)
#   bash benchmarks/run_gpu.sh pool    # memory, scheduler and train GPU tests; clipped B8 with its held host
#                                      # gradients sharing the activations' memory, without, and with again
#   bash benchmarks/run_gpu.sh poolshare # clipped B8 with the pool at device share 0.625 and 0.5; without it
#   bash benchmarks/run_gpu.sh poolshare2 # clipped B8 with the pool at device share 0.4375, 0.5 and 0.375
#   bash benchmarks/run_gpu.sh poolfinal # clipped B8 with the pool at its default share and without, twice
#   bash benchmarks/run_gpu.sh kernels # slide-kernels' GPU tests, the fused loss's pieces (lce_probe.py), then
#                                      # benchmarks/kernels.py against eager, torch.compile and Liger-Kernel
#                                      # (carry .whl-kernels: Liger's wheel)
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$(printf "$root/packages/%s/src:" slide-kernels slide-memory slide-io slide-scheduler slide-train)
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/slide-gpu}
mkdir -p "$out"
bench() { python3 "$root/benchmarks/engine.py" --out "$out" --steps 3 --warmup 2 "$@" 2>&1 | tail -2; }
# A run on the base engine (compare, handoff): .cmp's slide-scheduler goes first on PYTHONPATH (each JSON's
# config.scheduler_src says which one ran); the rest of the stack is this checkout's
base() { PYTHONPATH="$root/.cmp/packages/slide-scheduler/src:$PYTHONPATH" bench "$@"; }
keep() {  # keep TARBALL: move what the last run wrote under $out into TARBALL, so a call cut short returns it
  (cd "$out" && find . -maxdepth 1 -type f ! -name "$1" -printf '%P\0' | xargs -0r tar rf "$1" --remove-files)
}
gpu_tests() {  # gpu_tests [pytest options --] package...: each package's GPU-marked tests, a log each
  local opts=()
  if [ "${2:-}" = "--" ]; then opts=("$1"); shift 2; fi
  for p in "$@"; do
    (cd "$root/packages/$p" && python3 -m pytest -q -m gpu tests -p no:cacheprovider "${opts[@]}") \
      > "$out/gpu-tests-$p.log" 2>&1
    echo "gpu tests $p: exit $?"; tail -1 "$out/gpu-tests-$p.log"
  done
}
install_liger() {  # Liger-Kernel's wheel, carried in .whl-kernels (the peer of the kernel benchmarks)
  if ls "$root"/.whl-kernels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "$root"/.whl-kernels/*.whl &&
      export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
}
b3="--model llama-3.2-3b --seq 4096 --micro 2 --accum 4 --cap 24"
b8="--model llama-3.1-8b --seq 4096 --micro 1 --accum 8 --cap 16 --peer none"
case ${1:-small} in
small)
  gpu_tests -s -- slide-memory slide-scheduler slide-train
  bench $b3 --peer plain --tag B3
  bench $b3 --peer none --device-share 0 --tag B3-hostonly
  bench $b3 --peer none --clip none --tag B3-noclip
  bench --model llama-3.2-1b --seq 2048 --micro 4 --accum 1 --cap 24 --peer plain --tag B1
  ;;
b8)
  bench $b8 --clip none --tag B8-noclip
  bench $b8 --tag B8
  ;;
clip)
  gpu_tests slide-scheduler
  bench $b3 --peer plain --tag B3
  bench $b3 --peer none --split 0 --tag B3-whole
  bench $b3 --peer none --device-share 0.33 --tag B3-share33
  bench $b8 --tag B8
  bench $b8 --device-share 0.33 --tag B8-share33
  rm -f "$out"/B3-whole-timeline.png "$out"/*share33-timeline.png  # the machine returns at most 8 files
  ;;
final)  # every package's GPU tests, the fused loss against Liger, B3 (peer; clipped, also with the allocator's
  # fixed segments) and B1 (peer)
  gpu_tests slide-kernels slide-memory slide-scheduler slide-train
  install_liger
  python3 "$root/benchmarks/kernels.py" --out "$out" --ops linear_cross_entropy --providers eager,liger,slide \
    --rounds 3 2>&1 | tail -8
  bench $b3 --peer plain --tag B3
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False bench $b3 --peer none --tag B3-fixedseg  # allocator default
  bench --model llama-3.2-1b --seq 2048 --micro 4 --accum 1 --cap 24 --peer plain --tag B1
  cat "$out"/gpu-tests-*.log > "$out/gpu-tests.log"; rm -f "$out"/gpu-tests-slide-*.log "$out"/B3-fixedseg-timeline.png
  ;;
check)
  gpu_tests slide-kernels slide-memory slide-scheduler slide-train
  cat "$out"/gpu-tests-*.log > "$out/gpu-tests.log"; rm -f "$out"/gpu-tests-slide-*.log
  bench $b8 --tag B8
  install_liger
  python3 "$root/benchmarks/lce_probe.py" --out "$out" --rows "" --whole 0 2>&1 | tail -4
  bench $b8 --clip none --tag B8-noclip
  ;;
host)
  python3 "$root/benchmarks/host_memory.py" --out "$out" 2>&1 | tail -20
  bench $b3 --peer plain --tag B3
  bench $b3 --peer none --clip none --tag B3-noclip
  bench --model llama-3.2-1b --seq 2048 --micro 4 --accum 1 --cap 24 --peer plain --tag B1
  ;;
states)
  (cd "$root/packages/slide-kernels" && python3 -m pytest -q tests -p no:cacheprovider) > "$out/kernels-suite.log" 2>&1
  echo "slide-kernels suite: exit $?"; tail -1 "$out/kernels-suite.log"
  bench $b8 --states bf16 --tag B8-bf16states
  ;;
threads)
  { nproc; lscpu; numactl -H 2>&1; cat /sys/fs/cgroup/cpu.max 2>&1; } > "$out/host-cpus.txt"
  bench $b3 --peer plain --tag B3
  for t in 15 14 12; do bench $b3 --peer none --threads $t --tag B3-t$t; done
  bench $b3 --peer none --threads 14 --host-block 65536 --tag B3-t14-hb64k
  bench $b3 --peer none --threads 14 --clip none --tag B3-noclip-t14
  for t in 16 15; do python3 "$root/benchmarks/optimizer_gil.py" --threads $t --out "$out" 2>&1 | tail -3; done
  rm -f "$out"/*-trace.json
  (cd "$out" && tar czf threads.tgz --remove-files -- *)  # the machine returns at most 8 files
  ;;
land)
  gpu_tests slide-memory slide-scheduler slide-train
  cat "$out"/gpu-tests-*.log > "$out/gpu-tests.log"; rm -f "$out"/gpu-tests-slide-*.log
  python3 "$root/benchmarks/lane_probe.py" --out "$out" 2>&1 | grep GB/s
  bench $b3 --peer plain --tag B3
  bench $b8 --tag B8
  ;;
buffers)  # each with its 2-buffer baseline in the same call (no peer: it is the engine against itself)
  bench $b3 --peer none --tag B3
  bench $b3 --peer none --stream-buffers 3 --tag B3-buffers3
  bench $b8 --tag B8
  bench $b8 --stream-buffers 3 --tag B8-buffers3
  ;;
carveout)
  gpu_tests slide-scheduler
  python3 "$root/benchmarks/lane_probe.py" --out "$out" --carveouts 0,8,16 2>&1 | grep -E "GB/s|ms$"
  ;;
verify)
  gpu_tests slide-memory slide-scheduler slide-train
  cat "$out"/gpu-tests-*.log > "$out/gpu-tests.log"; rm -f "$out"/gpu-tests-slide-*.log
  bench $b3 --peer plain --tag B3
  bench $b3 --peer none --tag B3-again
  bench $b8 --tag B8
  bench $b8 --tag B8-again
  (cd "$out" && tar czf verify.tgz --remove-files -- *)  # the machine returns at most 8 files
  ;;
window)  # (this mode and the next two tar each run's files as soon as it ends)
  gpu_tests slide-memory slide-scheduler slide-train; keep window.tar
  bench $b3 --peer plain --window 2 --tag B3; keep window.tar
  bench $b3 --peer none --window 3 --tag B3-w3; keep window.tar
  bench $b3 --peer none --window 2 --tag B3-again; keep window.tar
  bench $b3 --peer none --window 3 --tag B3-w3-again; keep window.tar
  bench $b8 --window 2 --tag B8; keep window.tar
  bench $b8 --window 3 --tag B8-w3; keep window.tar
  ;;
share)
  gpu_tests slide-scheduler slide-train; keep share.tar
  bench $b3 --peer plain --tag B3; keep share.tar
  bench $b8 --tag B8; keep share.tar
  bench $b8 --device-share 0.5625 --tag B8-share56; keep share.tar
  bench $b8 --device-share 0.625 --tag B8-share62; keep share.tar
  bench $b3 --peer none --clip none --tag B3-noclip; keep share.tar
  ;;
tail)
  gpu_tests slide-train
  python3 "$root/benchmarks/tail.py" --out "$out" 2>&1 | tail -30
  ;;
handoff)
  python3 "$root/benchmarks/host_memory.py" --handoff --out "$out" 2>&1 | tail -30
  { free -g; grep . /sys/kernel/mm/transparent_hugepage/{enabled,defrag} /proc/sys/vm/{swappiness,overcommit_memory}
  } > "$out/host-mm.txt" 2>&1; keep handoff.tar
  bench $b8 --tag B8; keep handoff.tar
  base $b8 --tag B8-base; keep handoff.tar
  bench $b8 --tag B8-r2; keep handoff.tar
  base $b8 --tag B8-base-r2; keep handoff.tar
  ;;
compare)
  gpu_tests slide-memory slide-scheduler slide-train; keep compare.tar
  bench $b3 --peer plain --tag B3; keep compare.tar
  base $b3 --peer none --tag B3-base; keep compare.tar
  bench $b8 --tag B8; keep compare.tar
  base $b8 --tag B8-base; keep compare.tar
  bench $b3 --peer none --tag B3-again; keep compare.tar
  base $b3 --peer none --tag B3-base-again; keep compare.tar
  ;;
sweep)  # device update share with the store lane: clipped B3 (peer) and B8, alternating shares (tarred run by run)
  bench $b3 --peer plain --tag B3; keep sweep.tar
  bench $b8 --tag B8; keep sweep.tar
  bench $b8 --device-share 0.625 --tag B8-share62; keep sweep.tar
  bench $b3 --peer none --device-share 0.5625 --tag B3-share56; keep sweep.tar
  bench $b8 --device-share 0.5625 --tag B8-share56; keep sweep.tar
  bench $b3 --peer none --device-share 0.625 --tag B3-share62; keep sweep.tar
  ;;
balance)  # the 2-buffer, share-0.5 baselines are the ship call's noship runs (same engine, 2026-11-30)
  bench $b3 --peer none --stream-buffers 3 --tag B3-buffers3
  bench $b3 --peer none --device-share 0.4 --tag B3-share40
  bench $b3 --peer none --stream-buffers 3 --device-share 0.4 --tag B3-buffers3-share40
  bench $b8 --stream-buffers 3 --tag B8-buffers3
  bench $b8 --stream-buffers 3 --device-share 0.55 --tag B8-buffers3-share55
  (cd "$out" && tar czf balance.tgz --remove-files -- *)  # the machine returns at most 8 files
  ;;
pool)  # held gradients sharing the activations' memory: GPU tests; clipped B8 with it and without, alternating
  gpu_tests slide-memory slide-scheduler slide-train; keep pool.tar
  bench $b8 --share-acts 1 --tag B8-pool; keep pool.tar
  bench $b8 --share-acts 0 --tag B8; keep pool.tar
  bench $b8 --share-acts 1 --tag B8-pool-again; keep pool.tar
  ;;
poolshare)  # the device share with the pool: clipped B8 at 0.625 and 0.5 with it, then without it (0.5625)
  bench $b8 --share-acts 1 --device-share 0.625 --tag B8-pool-share62; keep poolshare.tar
  bench $b8 --share-acts 1 --device-share 0.5 --tag B8-pool-share50; keep poolshare.tar
  bench $b8 --share-acts 0 --tag B8; keep poolshare.tar
  ;;
poolshare2)  # clipped B8 with the pool at 0.4375, 0.5 and 0.375
  bench $b8 --share-acts 1 --device-share 0.4375 --tag B8-pool-share44; keep poolshare2.tar
  bench $b8 --share-acts 1 --device-share 0.5 --tag B8-pool-share50-again; keep poolshare2.tar
  bench $b8 --share-acts 1 --device-share 0.375 --tag B8-pool-share38; keep poolshare2.tar
  ;;
poolfinal)  # clipped B8 with the pool (its default share, 0.375) and without it, alternating, twice
  bench $b8 --share-acts 1 --tag B8-pool; keep poolfinal.tar
  bench $b8 --share-acts 0 --tag B8; keep poolfinal.tar
  bench $b8 --share-acts 1 --tag B8-pool-again; keep poolfinal.tar
  bench $b8 --share-acts 0 --tag B8-again; keep poolfinal.tar
  ;;
kernels)
  install_liger
  gpu_tests slide-kernels
  python3 "$root/benchmarks/lce_probe.py" --out "$out" 2>&1 | tail -14
  python3 "$root/benchmarks/kernels.py" --out "$out" --rounds 3 2>&1 | tail -30
  ;;
esac
# The device machine returns only a few files per call: keep the JSON and PNGs, drop the Perfetto traces.
rm -f "$out"/*-trace.json
