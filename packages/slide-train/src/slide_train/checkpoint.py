"""Checkpoints that resume exactly: fp32 masters, AdamW states, step, data position and RNG states.

Layout of `RUN_DIR/checkpoints/step-<N>/`: one safetensors file per unit (`edges`, `block-000`, ...) holding its
master and optimizer state, `trainer.json` (step, data position, config), `rng.safetensors`, and
`manifest.json` with the size and SHA-256 of every other file. A checkpoint is written under a temporary name,
fsynced and renamed, so a crash never leaves a half-written `step-<N>` (one written again replaces the old copy
the same way); the manifest catches later damage.
Nothing here is pickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from slide_io import free_bytes, is_disk_full
from slide_scheduler import DTYPES, host_cores

from .errors import CheckpointError, DiskFullError, size_text
from .progress import bar
from .space import Size, safetensors_bytes, write_within

MANIFEST = "manifest.json"
# Files are hashed on these threads beside the writes of the next ones: one SHA-256 stream is slower than a fast
# drive writes
HASH_THREADS = max(1, min(8, host_cores() // 2))


def _hashers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="slide-hash")


def unit_file(name: str) -> str:
    return "edges.safetensors" if name == "edges" else f"block-{int(name.split('.')[1]):03d}.safetensors"


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unit_tensors(numel: int, states: torch.dtype) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of what a unit's file holds once it has been updated: its flat fp32 master, the AdamW
    step count and the two moments in `states`."""
    return [("master", torch.float32, (numel,)), ("adamw.step", torch.float32, ()),
            ("adamw.exp_avg", states, (numel,)), ("adamw.exp_avg_sq", states, (numel,))]


def rng_states() -> dict[str, torch.Tensor]:
    """The generators' states a checkpoint keeps (rng.safetensors): the CPU's and every CUDA device's."""
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return rng


def _rng_shapes() -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """What rng.safetensors holds, without reading the CUDA states (which would start a context on every GPU):
    a CUDA generator's state is its seed and offset, 16 bytes."""
    shapes = [("torch", torch.uint8, tuple(torch.get_rng_state().shape))]
    if torch.cuda.is_available():
        shapes += [(f"cuda.{i}", torch.uint8, (16,)) for i in range(torch.cuda.device_count())]
    return shapes


def _manifest_text(step: int, files: dict[str, dict]) -> str:
    return json.dumps({"step": step, "files": files}, indent=2)


def checkpoint_size(unit_numels, resident: set[int], states_dtype: str, trainer_state: dict | None = None,
                    step: int = 0, rng: dict[str, torch.Tensor] | None = None) -> Size:
    """What one checkpoint takes, from the bytes of its files: every unit's safetensors file (the AdamW moments
    fp32 for the `resident` units, kept on the device, `states_dtype` for the rest), rng.safetensors,
    trainer.json (of `trainer_state`) and the manifest."""
    host_states = DTYPES[states_dtype]
    sizes = {unit_file("edges" if i == 0 else f"block.{i - 1}"):
             safetensors_bytes(unit_tensors(n, torch.float32 if i in resident else host_states))
             for i, n in enumerate(unit_numels)}
    sizes["rng.safetensors"] = safetensors_bytes(
        [(k, v.dtype, tuple(v.shape)) for k, v in rng.items()] if rng is not None else _rng_shapes())
    sizes["trainer.json"] = len(json.dumps(trainer_state or {}, indent=2).encode())
    manifest = _manifest_text(step, {k: {"bytes": n, "sha256": "0" * 64} for k, n in sorted(sizes.items())})
    return Size(sum(sizes.values()) + len(manifest.encode()), len(sizes) + 2)  # the manifest and the folder


def checkpoint_bytes(unit_numels, resident: set[int], states_dtype: str, trainer_state: dict | None = None,
                     step: int = 0) -> int:
    """The free bytes one checkpoint asks for: `checkpoint_size` and its margin."""
    return checkpoint_size(unit_numels, resident, states_dtype, trainer_state, step).needed


def engine_checkpoint_bytes(engine, trainer_state: dict | None = None, step: int = 0,
                            rng: dict[str, torch.Tensor] | None = None) -> int:
    states = "bf16" if engine.placement.state_bytes == 2 else "fp32"
    return checkpoint_size([u.layout.base_numel for u in engine.units], engine.resident, states, trainer_state, step,
                           rng).needed


def save_checkpoint(root: pathlib.Path, step: int, engine, trainer_state: dict, check=None) -> pathlib.Path:
    """Write `step-<step>` under `root`; a disk too small for it raises DiskFullError before anything is written
    (or, if the disk fills while writing, after removing the partial files). `check(name, master)` sees each
    unit's master as it is written (one read of a master on disk, not two) and may raise: nothing of the
    checkpoint is then left.

    Data-parallel ranks all call it: the first gathers every unit's shards and writes the files, as one process
    would; the others give their shards and learn the outcome, so that every rank raises alike."""
    rng = rng_states()
    needed, tmp = engine_checkpoint_bytes(engine, trainer_state, step, rng), root / f".step-{step}.partial"
    ranks = engine.ranks
    if ranks.sharded and not ranks.share(float(not ranks.lead or needed <= free_bytes(root))):
        raise _disk_full(root, step, needed, free_bytes(root))
    if not ranks.lead:
        return _give_shards(root, step, engine, needed)
    return write_within(root, 0 if ranks.sharded else needed, tmp,  # (sharded: checked and shared above)
                        lambda: _write(root, tmp, root / f"step-{step}", step, engine, trainer_state, rng, check),
                        lambda free: _disk_full(root, step, needed, free))


def _disk_full(root: pathlib.Path, step: int, needed: int, free: int) -> DiskFullError:
    earlier = list_checkpoints(root)
    intact = f"the latest checkpoint ({earlier[-1].name}) is intact" if earlier else "no earlier checkpoint exists"
    return DiskFullError(
        f"checkpoint step-{step} needs about {size_text(needed)} in {root}, but only {size_text(free)} are "
        f"free there: free some space, keep fewer checkpoints (checkpoint.keep; 0 writes none), or set output_dir "
        f"on a larger disk. Nothing of step-{step} was left behind; {intact}")


def _write(root: pathlib.Path, tmp: pathlib.Path, final: pathlib.Path, step: int, engine,
           trainer_state: dict, rng: dict[str, torch.Tensor], check=None) -> pathlib.Path:
    sharded = engine.ranks.sharded
    error = None
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    except OSError as e:
        error = e
    engine.synchronize()  # updates of the last step may still be running on the optimizer thread
    manifest: dict[str, tuple[int, Future]] = {}
    hashing = _hashers()

    def written(path: pathlib.Path) -> None:  # hashed while the page cache still holds what was written
        manifest[path.name] = (path.stat().st_size, hashing.submit(_sha256, path))

    for index, name in enumerate(bar(engine.unit_names(), desc=f"writing step-{step}", unit="file")):
        if error is not None and not sharded:
            break
        try:  # (sharded, every unit is gathered whatever happened: the other ranks take part to the last)
            master = engine.master(index)
            states = engine.optimizer_state(index)
            if error is not None:
                continue
            if check is not None:
                check(name, master)
            save_file({"master": master} | {f"adamw.{k}": v for k, v in states.items()}, str(tmp / unit_file(name)))
            written(tmp / unit_file(name))
        except BaseException as e:
            error = error or e
    if error is None:
        try:
            _finish(root, tmp, final, step, trainer_state, rng, manifest, written)
        except BaseException as e:
            error = e
    hashing.shutdown(cancel_futures=True)  # (before the partial files go, on an error)
    if sharded:  # what the other ranks learn: written, a full disk, or another failure
        engine.ranks.share(0 if error is None else FULL if is_disk_full(error) else FAILED)
    if error is not None:
        if tmp.exists():  # (gone once renamed into place: a later step of _finish failed)
            shutil.rmtree(tmp, ignore_errors=True)
        raise error
    return final


def _finish(root: pathlib.Path, tmp: pathlib.Path, final: pathlib.Path, step: int, trainer_state: dict,
            rng: dict[str, torch.Tensor], hashed: dict[str, tuple[int, Future]], written) -> None:
    """The checkpoint's last files and its manifest (once every file's hash is in), synced, then `tmp` renamed
    into place."""
    save_file(rng, str(tmp / "rng.safetensors"))
    written(tmp / "rng.safetensors")
    (tmp / "trainer.json").write_text(json.dumps(trainer_state, indent=2))
    written(tmp / "trainer.json")
    manifest = {name: {"bytes": size, "sha256": digest.result()} for name, (size, digest) in sorted(hashed.items())}
    files = [tmp / name for name in manifest]
    (tmp / MANIFEST).write_text(_manifest_text(step, manifest))
    for p in [*files, tmp / MANIFEST]:
        _fsync(p)
    # A step written again (a stop right after a periodic checkpoint, a redone step) sets the old copy aside and
    # deletes it only once the new one is in place: deleting first left no whole copy for a process killed then.
    aside = root / f".step-{step}.replaced"
    if aside.exists():  # left by a process that died while deleting it
        shutil.rmtree(aside)
    if final.exists():
        final.rename(aside)
    tmp.rename(final)
    _fsync(root)
    if aside.exists():
        shutil.rmtree(aside)


FULL, FAILED = 1, 2  # what the first rank tells the others of a checkpoint it could not write


def _give_shards(root: pathlib.Path, step: int, engine, needed: int) -> pathlib.Path:
    """A data-parallel rank's part of a checkpoint the first rank writes: the same gathers, unit by unit."""
    engine.synchronize()
    for index in range(len(engine.units)):
        engine.master(index)
        engine.optimizer_state(index)
    outcome = engine.ranks.share(0)
    if outcome == FULL:
        raise _disk_full(root, step, needed, free_bytes(root))
    if outcome == FAILED:
        raise CheckpointError(f"the first rank could not write checkpoint step-{step} in {root}: its error says why")
    return root / f"step-{step}"


def verify(path: pathlib.Path) -> dict:
    """The manifest of a checkpoint, after checking every file's size and checksum; CheckpointError if not."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it is incomplete or not a checkpoint")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        # valid JSON of another shape ([], {"files": []}, an entry without its size) is as corrupt
        if not all(isinstance(m, dict) and isinstance(m.get("bytes"), int) and isinstance(m.get("sha256"), str)
                   for m in files.values()):
            raise ValueError("a file entry lacks its bytes or sha256")
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # (JSON and Unicode decode errors are ValueErrors)
        raise CheckpointError(f"{manifest_path} is corrupt ({type(e).__name__}: {e})") from e
    for name, meta in files.items():  # (every size before any hash: a cut file is named at once)
        p = path / name
        if not p.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}")
        if p.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"{p} has {p.stat().st_size} bytes, the manifest says {meta['bytes']}: "
                                  "the file is truncated or was changed")
    with _hashers() as hashing:
        digests = hashing.map(_sha256, [path / name for name in files])
        for (name, meta), digest in bar(zip(files.items(), digests), desc=f"verifying {path.name}", unit="file",
                                        total=len(files)):
            if digest != meta["sha256"]:
                hashing.shutdown(cancel_futures=True)
                raise CheckpointError(f"{path / name} does not match its checksum in the manifest: the file is "
                                      "corrupt")
    return manifest


def list_checkpoints(root: pathlib.Path) -> list[pathlib.Path]:
    """Finished checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()]
    return sorted(found, key=step_of)


def find_resumable(root: pathlib.Path) -> pathlib.Path | None:
    """The newest checkpoint that verifies; damaged newer ones are reported and skipped. None when there is
    none at all; CheckpointError when every one is damaged (starting over would silently lose the run)."""
    problems, found = [], list_checkpoints(root)
    for index in range(len(found) - 1, -1, -1):
        try:
            verify(found[index])
            return found[index]
        except CheckpointError as e:
            problems.append(str(e))
            if index:  # (the last one damaged: the error below says so)
                warnings.warn(f"skipping damaged checkpoint: {e}; falling back to {found[index - 1].name}",
                              stacklevel=2)
    if problems:
        raise CheckpointError(f"every checkpoint in {root} is damaged, nothing to resume from: "
                              f"{'; '.join(problems)}. Restore them, or start afresh with --overwrite=true "
                              "(which deletes them)")
    return None


def load_checkpoint(path: pathlib.Path, engine) -> dict:
    """Restore masters and optimizer states into `engine` from a checkpoint already verified (`find_resumable`
    or `verify`: hashing an 8B checkpoint takes a while, so once); returns trainer.json."""
    engine.synchronize()
    for index, name in enumerate(bar(engine.unit_names(), desc=f"loading {path.name}", unit="file")):
        try:
            tensors = load_file(str(path / unit_file(name)))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {path / unit_file(name)}: {e}") from e
        master = tensors.pop("master")
        numel = engine.units[index].layout.base_numel
        if master.shape != (numel,):
            raise CheckpointError(f"{path / unit_file(name)} holds {master.numel()} parameters, the model has "
                                  f"{numel}: the checkpoint is from another model")
        engine.load_master(index, master)
        engine.load_optimizer_state(index, {k.removeprefix("adamw."): v for k, v in tensors.items()})
    engine.refresh()
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["torch"])
    cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda."))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    return json.loads((path / "trainer.json").read_text())


def step_of(path: pathlib.Path) -> int:
    return int(path.name[5:])


def replaced(root: pathlib.Path, resumed_step: int | None, step: int) -> list[pathlib.Path]:
    """After a resume from `resumed_step`, until the run's first save (at `step`): the checkpoints of the course
    that resume replaced, those after `resumed_step` other than `step`'s."""
    if resumed_step is None:
        return []
    return [p for p in list_checkpoints(root) if resumed_step < step_of(p) != step]


def spare(root: pathlib.Path, resumed_step: int | None, step: int) -> list[pathlib.Path]:
    """The checkpoints a last (or stopping) save at `step` may delete to make room, in order: those of a replaced
    course, then older ones oldest first, never the newest of those (after a resume, the one resumed from), so
    the run keeps one good checkpoint whatever happens to the new one."""
    gone = replaced(root, resumed_step, step)
    older = [p for p in list_checkpoints(root) if step_of(p) < step and p not in gone]
    return gone + older[:-1]


def prune(root: pathlib.Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints."""
    found = list_checkpoints(root)
    for path in found[: max(0, len(found) - keep)]:
        shutil.rmtree(path)


def read_masters(path: pathlib.Path, layouts: dict[str, object]) -> dict[str, dict[str, torch.Tensor]]:
    """Unit name -> parameter name -> fp32 tensor, read from a checkpoint already verified."""
    out = {}
    for name, layout in layouts.items():
        master = load_file(str(path / unit_file(name)))["master"]
        out[name] = layout.views(master)
    return out


def unit_layouts(stack) -> dict[str, object]:
    """Unit name -> the `FlatLayout` of its master, as the engine lays out `stack`'s units (unsharded)."""
    from slide_scheduler import layouts_of

    return layouts_of(stack).units()
