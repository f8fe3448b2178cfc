"""The sizes of the engine's fixed buffers: how many of each the placement counts and the executors allocate, and
the page layout of the host memory boundary activations share with gradients (pool.py). The plan owns them; the
executors (disk_states.py, disk_activations.py, pool.py, the engine) read them from here or from the placement.

slide-memory's optimizer counts the bytes of its own buffers (`host_scratch_bytes`, `device_scratch_bytes`,
`streamed_step_bytes`: the placement calls them); a device-update piece's alignment is the one size of its that
the scheduler reads, here."""

from __future__ import annotations

from slide_memory import PIECE_ALIGN

__all__ = ["ALIGN", "DISK_STAGING_SLOTS", "GRADS_TO_DISK", "LOAD_SLOTS", "PIECE_ALIGN",
           "SLOTS_PER_MICRO", "pool_bytes", "pool_layout"]

DISK_STAGING_SLOTS = 2  # staging slots of the disk tier's states, one block's m and v each, unless the placement says
LOAD_SLOTS = 2  # buffers a master read from disk for a load waits in until it has crossed to the device
GRADS_TO_DISK = 2  # host buffers gradients on their way to disk take turns in
SLOTS_PER_MICRO = 2  # buffers per micro-batch in each ring of activations on disk: two blocks' boundaries on their way
ALIGN = 4096  # every region of the shared pool starts on a page


def page_round(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pool_layout(blocks: list[int], grad_bytes: int, boundary_bytes: int, boundaries: int) -> tuple[int, dict[int, int]]:
    """(pool bytes, block -> offset of its gradient) with boundary j at [j, j + 1) * `boundary_bytes` and each
    listed block's gradient (`grad_bytes`) clear of boundaries 0 to its own. Sizes already page-rounded."""
    size = boundaries * boundary_bytes
    order = sorted(blocks, reverse=True)
    for k, block in enumerate(order, 1):  # the k-th gradient from the top ends its clearance at (block + 1)
        size = max(size, k * grad_bytes + (block + 1) * boundary_bytes)
    return size, {block: size - k * grad_bytes for k, block in enumerate(order, 1)}


def boundary_layout(micro_bytes: list[int]) -> tuple[list[int], int]:
    """Where each micro-batch's activation starts within a boundary, and the boundary's bytes."""
    offsets, total = [], 0
    for nbytes in micro_bytes:
        offsets.append(total)
        total += page_round(nbytes)
    return offsets, total


def pool_bytes(blocks: list[int], grad_bytes: int, micro_bytes: list[int], boundaries: int) -> int:
    """What a pool for these gradients and boundaries (of these micro-batch activations) takes; the planner's
    count."""
    return pool_layout(blocks, page_round(grad_bytes), boundary_layout(micro_bytes)[1], boundaries)[0]
