#!/usr/bin/env bash
# The GPU runs, one mode per call of the lent machine (each fits in its 10-minute limit). Results land in $OUT;
# copy them into benchmarks/results/ (set SLIDE_COMMIT: the device's copy has no .git). Modes that earlier
# sessions' results name and that are gone from here are in this script at the commit each result names
# (`git show <commit>:benchmarks/run_gpu.sh`).
#   bash benchmarks/run_gpu.sh small   # GPU tests, then B1 and B3 (the plain GPU-resident peer in the same run)
#   bash benchmarks/run_gpu.sh final   # every package's GPU tests, the fused loss vs Liger, B3 and B1 with the peer
#   bash benchmarks/run_gpu.sh check   # every package's GPU tests, B8 with clipping, the loss's matmul ceiling and
#                                      # the loss vs Liger, B8 without clipping
#   bash benchmarks/run_gpu.sh b8      # B8 without and with clipping (no peer: it does not fit this host)
#   bash benchmarks/run_gpu.sh compare # memory, scheduler and train GPU tests; clipped B3 (peer) and B8, each
#                                      # with this checkout's slide-scheduler and with a base one, alternating,
#                                      # B3 twice (about 9 minutes). Before:
#                                      # `mkdir -p .cmp && git archive BASE packages/slide-scheduler/src | tar x -C
#                                      # .cmp` (.cmp is git-ignored), and carry .cmp in the call
#   bash benchmarks/run_gpu.sh pool    # scheduler GPU tests; clipped B8 with its held host gradients sharing the activations' memory
#                                      # (the pool's default device share) and without, alternating, twice
#   bash benchmarks/run_gpu.sh poolb3  # scheduler GPU tests; clipped B3 (peer) with and without the pool, each
#                                      # twice, the pool at 0.5625 too; clipped B1 with the pool
#   bash benchmarks/run_gpu.sh defaults # train GPU tests; B3 (peer), B8 with its gradients pooled (the default)
#                                      # and not, B1 (peer)
#   bash benchmarks/run_gpu.sh stall   # memory, scheduler and train GPU tests; the pool-replacement probe with
#                                      # stalled copies (pool_stall_probe.py), as is and deterministic; B1 (peer)
#   bash benchmarks/run_gpu.sh head    # the probe at lengths 800,1600 (both ways); B3 (peer), B8, B3 again:
#                                      # the defaults
#   bash benchmarks/run_gpu.sh last    # scheduler GPU tests; B8 without and with clipping, B3 (peer)
#   bash benchmarks/run_gpu.sh blocks  # the host AdamW (whole, params part, moments part) by block size per thread
#   bash benchmarks/run_gpu.sh nvme    # the disk under the checkout (rates by dd); clipped B8 with 1/8 and B3 with
#                                      # 1/4 of the sliding blocks' AdamW states on it
#   bash benchmarks/run_gpu.sh acts    # scheduler and train GPU tests; the disk under the checkout; clipped B8
#                                      # with its boundary activations on it, and in host memory
#   bash benchmarks/run_gpu.sh b3trace # memory, scheduler and train GPU tests; clipped B3 (peer) with the pool (the
#                                      # default) and with a buffer each, keeping both Perfetto traces
#   bash benchmarks/run_gpu.sh b3share # clipped B3 (peer) with the pool at device share 0.375 (the default: 7 of its
#                                      # 21 sliding blocks), 10/21 and 9/21, alternating
#   bash benchmarks/run_gpu.sh actsfree # unclipped B8 with its boundary activations on the disk under the checkout,
#                                      # then in host memory (2 timed steps after 1: the host memory each takes)
#   bash benchmarks/run_gpu.sh probes  # the host's CPUs and memory settings; host memory bandwidth alone and under
#                                      # PCIe copies, and the params part's handoff (host_memory.py); copies beside
#                                      # GEMMs (lane_probe.py); the optimizer thread beside a busy one
#   bash benchmarks/run_gpu.sh tail    # train GPU tests; the tail on the tokens with a target only (tail.py)
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
# A run on the base engine (compare): .cmp's slide-scheduler goes first on PYTHONPATH (each JSON's
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
b1="--model llama-3.2-1b --seq 2048 --micro 4 --accum 1 --cap 24"
b8="--model llama-3.1-8b --seq 4096 --micro 1 --accum 8 --cap 16 --peer none"
case ${1:-small} in
small)
  gpu_tests -s -- slide-memory slide-scheduler slide-train
  bench $b3 --peer plain --tag B3
  bench $b3 --peer none --device-share 0 --tag B3-hostonly
  bench $b3 --peer none --clip none --tag B3-noclip
  bench $b1 --peer plain --tag B1
  ;;
b8)
  bench $b8 --clip none --tag B8-noclip
  bench $b8 --tag B8
  ;;
final)  # every package's GPU tests, the fused loss against Liger, B3 (peer; clipped, also with the allocator's
  # fixed segments) and B1 (peer)
  gpu_tests slide-kernels slide-memory slide-scheduler slide-train
  install_liger
  python3 "$root/benchmarks/kernels.py" --out "$out" --ops linear_cross_entropy --providers eager,liger,slide \
    --rounds 3 2>&1 | tail -8
  bench $b3 --peer plain --tag B3
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False bench $b3 --peer none --tag B3-fixedseg  # allocator default
  bench $b1 --peer plain --tag B1
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
compare)
  gpu_tests slide-memory slide-scheduler slide-train; keep compare.tar
  bench $b3 --peer plain --tag B3; keep compare.tar
  base $b3 --peer none --tag B3-base; keep compare.tar
  bench $b8 --tag B8; keep compare.tar
  base $b8 --tag B8-base; keep compare.tar
  bench $b3 --peer none --tag B3-again; keep compare.tar
  base $b3 --peer none --tag B3-base-again; keep compare.tar
  ;;
pool)
  gpu_tests slide-scheduler; keep pool.tar
  bench $b8 --share-acts 1 --tag B8-pool; keep pool.tar
  bench $b8 --share-acts 0 --tag B8; keep pool.tar
  bench $b8 --share-acts 1 --tag B8-pool-again; keep pool.tar
  bench $b8 --share-acts 0 --tag B8-again; keep pool.tar
  ;;
poolb3)
  gpu_tests slide-scheduler; keep poolb3.tar
  bench $b3 --peer plain --tag B3; keep poolb3.tar
  bench $b3 --peer none --share-acts 1 --tag B3-pool; keep poolb3.tar
  bench $b3 --peer none --share-acts 0 --tag B3-again; keep poolb3.tar
  bench $b3 --peer none --share-acts 1 --tag B3-pool-again; keep poolb3.tar
  bench $b3 --peer none --share-acts 1 --device-share 0.5625 --tag B3-pool-share56; keep poolb3.tar
  bench $b1 --peer none --share-acts 1 --tag B1-pool; keep poolb3.tar
  ;;
defaults)
  gpu_tests slide-train; keep defaults.tar
  bench $b3 --peer plain --tag B3; keep defaults.tar
  bench $b8 --tag B8-pool; keep defaults.tar
  bench $b8 --share-acts 0 --tag B8; keep defaults.tar
  bench $b1 --peer plain --tag B1; keep defaults.tar
  ;;
stall)
  gpu_tests slide-memory slide-scheduler slide-train; keep stall.tar
  python3 "$root/benchmarks/pool_stall_probe.py" --out "$out" 2>&1 | tail -3; keep stall.tar
  python3 "$root/benchmarks/pool_stall_probe.py" --out "$out" --deterministic 2>&1 | tail -3; keep stall.tar
  bench $b1 --peer plain --tag B1; keep stall.tar
  ;;
head)  # (with the probe at the failed variant's lengths first)
  python3 "$root/benchmarks/pool_stall_probe.py" --out "$out" --lengths 800,1600 2>&1 | tail -2; keep head.tar
  python3 "$root/benchmarks/pool_stall_probe.py" --out "$out" --lengths 800,1600 --deterministic 2>&1 | tail -2
  keep head.tar
  bench $b3 --peer plain --tag B3; keep head.tar
  bench $b8 --tag B8; keep head.tar
  bench $b3 --peer none --tag B3-again; keep head.tar
  ;;
last)
  gpu_tests slide-scheduler; keep last.tar
  bench $b8 --clip none --tag B8-noclip; keep last.tar
  bench $b8 --tag B8; keep last.tar
  bench $b3 --peer plain --tag B3; keep last.tar
  ;;
blocks)  # the host AdamW by block size per thread, alone and beside PCIe copies (an 8B block's parameters)
  python3 "$root/benchmarks/host_adamw.py" --numel 218112000 --runs 3 --sweep 14,15,16,17,18 \
    --out "$out/host-adamw-blocks.json" 2>&1 | grep gparams
  ;;
acts)  # boundary activations on the disk under the checkout (engine.activation_offload=nvme)
  gpu_tests slide-scheduler slide-train; keep acts.tar
  disk="$root/.bench-run"; mkdir -p "$disk"
  { df -h "$disk"; dd if=/dev/zero of="$disk/dd.bin" bs=16M count=256 oflag=direct conv=fsync 2>&1 | tail -1
    dd if="$disk/dd.bin" of=/dev/null bs=16M iflag=direct 2>&1 | tail -1; rm -f "$disk/dd.bin"; } > "$out/disk.txt"
  tail -2 "$out/disk.txt"; keep acts.tar
  bench $b8 --acts nvme --run-dir "$disk/run" --tag B8-acts-nvme; keep acts.tar
  bench $b8 --tag B8; keep acts.tar
  ;;
b3trace)
  gpu_tests slide-memory slide-scheduler slide-train; keep b3trace.tar
  bench $b3 --peer plain --tag B3; keep b3trace.tar
  bench $b3 --peer none --share-acts 0 --tag B3-each; keep b3trace.tar
  exit 0  # (the traces stay)
  ;;
b3share)
  bench $b3 --peer plain --tag B3; keep b3share.tar
  bench $b3 --peer none --device-share 0.477 --tag B3-share10; keep b3share.tar
  bench $b3 --peer none --tag B3-again; keep b3share.tar
  bench $b3 --peer none --device-share 0.477 --tag B3-share10-again; keep b3share.tar
  bench $b3 --peer none --device-share 0.43 --tag B3-share9; keep b3share.tar
  exit 0  # (the traces stay)
  ;;
actsfree)
  disk="$root/.bench-run"; mkdir -p "$disk"
  python3 "$root/benchmarks/engine.py" --out "$out" --steps 2 --warmup 1 $b8 --clip none --acts nvme \
    --run-dir "$disk/run" --tag B8-noclip-acts-nvme 2>&1 | tail -1; keep actsfree.tar
  python3 "$root/benchmarks/engine.py" --out "$out" --steps 2 --warmup 1 $b8 --clip none --tag B8-noclip \
    2>&1 | tail -1; keep actsfree.tar
  ;;
nvme)  # the disk the state files go to, its sequential rates; clipped B8 and B3 with some AdamW states on it
  disk="$root/.bench-run"; mkdir -p "$disk"
  { df -h "$disk" /tmp; findmnt -T "$disk"; lsblk -d -o NAME,ROTA,SIZE,MODEL; } > "$out/disk.txt" 2>&1
  { dd if=/dev/zero of="$disk/dd.bin" bs=16M count=256 oflag=direct conv=fsync 2>&1 | tail -1
    dd if="$disk/dd.bin" of=/dev/null bs=16M iflag=direct 2>&1 | tail -1; rm -f "$disk/dd.bin"; } >> "$out/disk.txt"
  tail -2 "$out/disk.txt"; keep nvme.tar
  bench $b8 --nvme 0.125 --run-dir "$disk/run" --tag B8-nvme12; keep nvme.tar
  bench $b3 --peer none --nvme 0.25 --run-dir "$disk/run" --tag B3-nvme25; keep nvme.tar
  ;;
probes)
  { nproc; lscpu; numactl -H; free -g; grep . /sys/kernel/mm/transparent_hugepage/{enabled,defrag} \
    /proc/sys/vm/{swappiness,overcommit_memory}; } > "$out/host.txt" 2>&1
  python3 "$root/benchmarks/host_memory.py" --out "$out" 2>&1 | tail -20
  python3 "$root/benchmarks/host_memory.py" --handoff --out "$out" 2>&1 | tail -10
  python3 "$root/benchmarks/lane_probe.py" --out "$out" 2>&1 | grep GB/s
  python3 "$root/benchmarks/optimizer_gil.py" --out "$out" 2>&1 | tail -3
  ;;
tail)
  gpu_tests slide-train
  python3 "$root/benchmarks/tail.py" --out "$out" 2>&1 | tail -30
  ;;
kernels)
  install_liger
  gpu_tests slide-kernels
  python3 "$root/benchmarks/lce_probe.py" --out "$out" 2>&1 | tail -14
  python3 "$root/benchmarks/kernels.py" --out "$out" --rounds 3 2>&1 | tail -30
  ;;
*)
  echo "unknown mode '$1': see the list at the top of $0" >&2; exit 2
  ;;
esac
# The device machine returns only a few files per call: keep the JSON and PNGs, drop the Perfetto traces.
rm -f "$out"/*-trace.json
