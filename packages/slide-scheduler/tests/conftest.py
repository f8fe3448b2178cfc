"""Shared by the scheduler's tests."""

import os

# cuBLAS reads this when it starts: with it (and torch.use_deterministic_algorithms) the GPU tests that compare
# runs bit for bit get the same arithmetic each run (benchmarks/pool_stall_probe.py: without, two identical toy
# runs at sequence length 1600 differed by an ulp).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
