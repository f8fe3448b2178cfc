"""`python -m slide_train ...`, as torchrun starts each rank: `torchrun --nproc-per-node 2 -m slide_train finetune`."""

import sys

from .cli import main

sys.exit(main())
