"""Shared by the scheduler's tests."""

import os

# cuBLAS reads this when it starts: with it (and torch.use_deterministic_algorithms) the GPU tests that compare
# runs bit for bit get the same arithmetic each run (without it, two identical toy runs at sequence length 1600
# differed by an ulp on an H200).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
