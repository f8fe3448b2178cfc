"""slide-memory: where training state lives between device visits.

Flat per-unit parameter layouts, host (pinned) buffers and arenas, pre-allocated GPU slots, and AdamW over flat
fp32 master weights on the host.
"""

from .__about__ import __version__
from .adamw import (
    BLOCK_PER_THREAD,
    CHUNK,
    PIECE_ALIGN,
    AdamWConfig,
    FlatAdamW,
    HostAdamW,
    StreamedStep,
    device_scratch,
    device_scratch_bytes,
    host_scratch_bytes,
    streamed_step_bytes,
)
from .host import HostArena, StagingRing, can_pin, host_empty, host_zeros
from .layout import ALIGN, Entry, FlatLayout
from .slots import Slot, SlotQueue

__all__ = [
    "ALIGN",
    "BLOCK_PER_THREAD",
    "CHUNK",
    "PIECE_ALIGN",
    "AdamWConfig",
    "Entry",
    "FlatAdamW",
    "FlatLayout",
    "HostAdamW",
    "HostArena",
    "Slot",
    "SlotQueue",
    "StagingRing",
    "StreamedStep",
    "__version__",
    "can_pin",
    "device_scratch",
    "device_scratch_bytes",
    "host_empty",
    "host_scratch_bytes",
    "host_zeros",
    "streamed_step_bytes",
]
