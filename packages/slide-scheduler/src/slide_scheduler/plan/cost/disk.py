"""The disk lane, every term of it: masters read for each load where their parameters have no copy in host
memory, the states of each block on disk read in ahead of its update and written back after it (its gradient
too where that waits there), and the boundary activations on disk. Each byte also crosses host memory. Each term
goes to the drive the placement puts its files on (stripe.py); the lane is the slowest drive's."""

from __future__ import annotations

from ..placement import DISK, Placement, early_reads_wait, kind_of
from ..stripe import Share, drive_shares
from .rates import Rates
from .work import PhaseWork, Work, loads_from_disk, master_on_disk


def read(w: PhaseWork, nbytes: float, r: Rates, drive: int = 0) -> None:
    w.on_drive(drive, nbytes / r.drives[drive][0])
    w.host_bytes += nbytes


def write(w: PhaseWork, nbytes: float, r: Rates, drive: int = 0) -> None:
    w.on_drive(drive, nbytes / r.drives[drive][1])
    w.host_bytes += nbytes


def block_disk(p: Placement, r: Rates) -> Work:
    """Where its update waits for the step's end (with clipping, or deferred), a block's states are read under the
    next forward, ahead of its update, and written back after it; the first updates' reads run under the backward,
    one per staging slot, where nothing the backward waits for reads the disk then. Where it runs in the backward,
    both run under the backward."""
    work = Work()
    fwd, bwd = work.forward, work.backward
    staged_early = 0
    # (the first waiting updates' reads run early only where no update of the backward's reads before them)
    eager = any(not p.waits(u) for u in p.on_disk)
    for u in p.sliding_blocks:
        unit, numel, drive, waits = p.units[u], p.shapes.unit_numels[u], p.drive_of(u), p.waits(u)
        if loads_from_disk(unit):  # its master as it loads, each pass
            read(fwd, 4 * numel, r, drive)
            if p.loads(u) > 1:  # (the last block's backward finds it still in its slot)
                read(bwd, 4 * numel, r, drive)
        if kind_of(unit.moments) != "files":
            continue
        early = waits and not eager and staged_early < p.staging_slots and not early_reads_wait(p)
        staged_early += early
        reads, writes = (bwd if early or not waits else fwd), work.update_phase(waits)
        states = p.disk_state_bytes(u) * numel
        read(reads, states, r, drive)
        write(writes, states, r, drive)
        if master_on_disk(unit) and not loads_from_disk(unit):  # the update writes the loads' copy too
            writes.host_bytes += p.compute_bytes * numel
        if unit.grad == "disk":  # written as the backward makes it, read back with the states
            write(bwd, p.compute_bytes * numel, r, drive)
            read(reads, p.compute_bytes * numel, r, drive)
    return work


def boundary_disk(p: Placement, r: Rates) -> Work:
    """The boundary activations on disk: written in the forward, read in the backward, each block's on its
    drive."""
    work = Work()
    if not p.boundary_drives:  # (one drive: the tier's bytes at once, as priced before striping)
        nbytes = p.boundaries_in(DISK) * p.boundary_bytes
        write(work.forward, nbytes, r)
        read(work.backward, nbytes, r)
        return work
    nbytes = p.boundary_bytes
    for block, tier in enumerate(p.boundary_tiers):
        if tier == DISK:
            drive = p.boundary_drive(block)
            write(work.forward, nbytes, r, drive)
            read(work.backward, nbytes, r, drive)
    return work


def disk_traffic(p: Placement, drive: int | None = None) -> tuple[int, int]:
    """Bytes the disk tier reads and writes per step, as `price` moves them: the states of each block there
    (its AdamW moments, and its master where that is there too) read and written back once, a master read for
    each load (forward and backward, but the last block's backward) where its parameters have no copy in host
    memory, and the boundary activations on disk written in the forward and read in the backward (stripe.py's
    shares, which count each drive's). `drive`: that drive's bytes alone."""
    shares = drive_shares(p, None if drive is None else drive + 1)
    share = shares[drive] if drive is not None else sum(shares, Share())
    return share.read, share.written
