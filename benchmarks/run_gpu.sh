#!/usr/bin/env bash
# One call on the lent GPU machine: the GPU tests, then the engine benchmarks B1 and B3, each with the plain
# GPU-resident peer measured in the same run. Everything lands in $OUT (copy the JSON into benchmarks/results/).
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$(printf "$root/packages/%s/src:" slide-kernels slide-memory slide-io slide-scheduler slide-train)
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/slide-gpu}
mkdir -p "$out"
(cd "$root/packages/slide-train" && python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -s) \
  > "$out/gpu-tests.log" 2>&1; echo "gpu tests: exit $?"; tail -3 "$out/gpu-tests.log"
python3 "$root/benchmarks/engine.py" --model llama-3.2-1b --seq 2048 --micro 1 --accum 4 --cap 24 --peer plain \
  --tag B1 --out "$out" --steps 3 --warmup 2 2>&1 | tail -4
python3 "$root/benchmarks/engine.py" --model llama-3.2-3b --seq 4096 --micro 2 --accum 4 --cap 24 --peer plain \
  --tag B3 --out "$out" --steps 3 --warmup 2 2>&1 | tail -4
