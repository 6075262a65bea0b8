"""Atomic, resumable checkpoints: checkpoints/step_<N>/ plus a `latest` pointer.

A checkpoint is written into a hidden temporary directory, every file fsynced, then renamed to step_<N>
(the rename is the commit) and the directory fsynced; `latest` is replaced atomically last. A crash at
any moment leaves either the old set of checkpoints or the new one, never a half-written step_<N>.
One writer per run directory (rank 0 under data parallelism).

Layout of step_<N>/: the trainer's files (model.safetensors, optimizer.pt, trainer.json), rng.pt
(python, numpy, torch and CUDA generator states) and state.json (step, data position, extras).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct
import time
import uuid
import zipfile
from dataclasses import asdict, dataclass, field
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from gymv.errors import GymvError, WriteError
from gymv.io import as_write_failure, atomic_write_text, follow_umask, nearest_existing, write_error

STATE_FILE = "state.json"
RNG_FILE = "rng.pt"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class Checkpointable(Protocol):
    def save(self, path: str | os.PathLike) -> None: ...
    def load(self, path: str | os.PathLike) -> None: ...


@dataclass
class DataPosition:
    """Where the data stream stands: the order of epoch e is a pure function of (shuffle_seed, e)."""

    epoch: int = 0
    index: int = 0
    shuffle_seed: int = 0


@dataclass
class CheckpointState:
    step: int
    path: Path
    data_position: DataPosition
    extra: dict[str, Any] = field(default_factory=dict)


def capture_rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state((npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"], npst["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _checkpoints_dir(path: str | os.PathLike) -> Path:
    """Accept a run directory or its checkpoints/ directory."""
    path = Path(path)
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def _safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file is unreadable (a bad header, or shorter or longer than its header says)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path.name} is truncated ({size} bytes)"
            n = struct.unpack("<Q", head)[0]
            if n > size - 8:
                return f"{path.name} is truncated (its header needs {n} bytes)"
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"{path.name} is unreadable ({type(e).__name__})"
    if size != 8 + n + end:
        return f"{path.name} is {size} bytes, its header says {8 + n + end} (truncated or damaged)"
    return None


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why step_<N>/ is not a complete checkpoint, or None: state.json must read, and every weights file
    (safetensors: header and size; torch .pt: zip directory) must be whole. Cheap: no tensor is read."""
    path = Path(path)
    try:
        state = json.loads((path / STATE_FILE).read_text())
        int(state["step"])
    except FileNotFoundError:
        return f"no {STATE_FILE}"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {STATE_FILE} ({type(e).__name__})"
    for f in sorted(path.rglob("*")):
        if f.suffix == ".safetensors":
            problem = _safetensors_problem(f)
            if problem:
                return problem
        elif f.suffix == ".pt" and not zipfile.is_zipfile(f):
            return f"{f.name} is truncated or damaged"
    return None


def _step_dirs(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    d = _checkpoints_dir(directory)
    if not d.is_dir():
        return []
    return sorted((int(m.group(1)), c) for c in d.iterdir() if (m := _STEP_DIR.match(c.name)) and c.is_dir())


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints (see checkpoint_problem), oldest first; temp dirs are ignored."""
    return [(n, p) for n, p in _step_dirs(directory) if checkpoint_problem(p) is None]


def unusable_checkpoints(directory: str | os.PathLike) -> list[tuple[Path, str]]:
    """step_<N> folders that are not complete checkpoints, with the reason of each."""
    return [(p, why) for _, p in _step_dirs(directory) if (why := checkpoint_problem(p)) is not None]


def check_finite_weights(directory: Path, step: int) -> None:
    """Refuse to commit a checkpoint whose weights hold NaN or inf (a diverged run): it would be the
    "newest complete checkpoint" every later resume starts from. Read tensor by tensor (memory-mapped)."""
    import torch
    from safetensors import safe_open

    for f in sorted(directory.rglob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                t = st.get_tensor(key)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise GymvError(f"the weights after step {step} hold non-finite values (NaN or inf), first in "
                                    f"{key!r}: training diverged, and this checkpoint was not written",
                                    where=f.name, fix="lower training.lr or set training.max_grad_norm, then "
                                                      "resume from the last checkpoint", exit_code=1)


ROOM_FIX = ("free disk space, point checkpoint.dir at a larger disk, lower checkpoint.keep, or set "
            "checkpoint.enabled: false")


def disk_room_warning(directory: str | os.PathLike, checkpoint_bytes: int, keep: int | None) -> str | None:
    """What to tell a run whose checkpoint disk cannot hold its checkpoints, or None where it can. Why at the
    launch: a checkpoint that does not fit stops the run at its first save, `checkpoint.period` steps of work
    later (a 7B VLM's checkpoint is 66 GB). Up to keep + 1 checkpoints share the disk: the new one is complete
    before the oldest goes; those already there are in the disk's use."""
    folder = nearest_existing(directory)
    free = shutil.disk_usage(folder).free
    there = len(list_checkpoints(directory))
    more = 1 if keep is None else max(1, keep + 1 - there)
    gb = lambda b: f"{b / 1e9:.1f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"  # noqa: E731
    if free < checkpoint_bytes:
        return (f"a checkpoint of this run takes about {gb(checkpoint_bytes)} and {folder} has {gb(free)} free: "
                f"the next checkpoint will not be written and the run will stop there (fix: {ROOM_FIX})")
    if free < more * checkpoint_bytes:
        return (f"a checkpoint of this run takes about {gb(checkpoint_bytes)}, up to {there + more} are on disk at "
                f"once (checkpoint.keep {keep}, and the one being written), and {folder} has {gb(free)} free: a "
                f"later checkpoint will not fit and the run will stop there (fix: {ROOM_FIX})")
    return None


def find_latest(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of a run (or checkpoints/ directory), or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def read_state(path: str | os.PathLike) -> CheckpointState:
    path = Path(path)
    try:
        raw = json.loads((path / STATE_FILE).read_text())
    except FileNotFoundError:
        raise GymvError("not a complete checkpoint (no state.json)", where=str(path),
                        fix="use find_latest() or pass a step_<N> directory") from None
    except ValueError as e:
        raise GymvError(f"unreadable state.json: {e}", where=str(path),
                        fix="resume from another checkpoint (this one is damaged): remove it and run again") from None
    return CheckpointState(step=int(raw["step"]), path=path, data_position=DataPosition(**raw["data_position"]), extra=raw.get("extra", {}))


class CheckpointManager:
    """Saves and restores full training state under one checkpoints/ directory, keeping the last `keep`."""

    def __init__(self, directory: str | os.PathLike, keep: int | None = None):
        if keep is not None and keep < 1:
            raise GymvError(f"checkpoint keep must be >= 1, got {keep}", where="checkpoint.keep",
                            fix="set keep to 1 or more, or leave it unset to keep all")
        self.directory = Path(directory)
        self.keep = keep

    def latest(self) -> Path | None:
        return find_latest(self.directory)

    def save(self, step: int, trainer: Checkpointable, data_position: DataPosition, extra: dict[str, Any] | None = None) -> Path:
        """Write step_<step> whole or not at all; a disk that refuses it (full, read-only) is a WriteError
        naming the checkpoint, and the checkpoints already there are untouched."""
        final = self.directory / f"step_{int(step)}"  # named in errors, never the temporary folder written
        try:
            return self._save(step, trainer, data_position, extra)
        except WriteError as e:
            raise WriteError(e.message, where=str(final), fix=e.fix, exit_code=e.exit_code) from None
        except Exception as e:
            refused = as_write_failure(e, self.directory)
            if refused is None:
                raise
            raise write_error(final, refused) from None

    def save_retrying(self, step: int, trainer: Checkpointable, data_position: DataPosition,
                      extra: dict[str, Any] | None = None, *, wait_s: float = 10.0,
                      say: Callable[[str], None] = lambda text: None) -> Path:
        """`save`, tried a second time after `wait_s` when the disk refused it (the trained state is still in
        the trainers' memory: space freed meanwhile saves it); a second refusal is a WriteError saying how
        the run continues from its newest complete checkpoint."""
        try:
            return self.save(step, trainer, data_position, extra)
        except WriteError as e:
            say(f"warning: the checkpoint of step {step} was not written: {e.one_line()}; the step's state is "
                f"kept in memory, trying again in {wait_s:g} s")
        time.sleep(wait_s)
        try:
            return self.save(step, trainer, data_position, extra)
        except WriteError as e:
            latest = self.latest()
            since = f"from {latest.name}, the newest complete checkpoint" if latest else "from the start (no checkpoint yet)"
            raise WriteError(f"the checkpoint of step {step} could not be written, twice: {e.message}", where=e.where,
                             fix=f"{e.fix}, then continue {since}: gymv train --resume {self.directory.parent}",
                             exit_code=1) from None

    def _save(self, step: int, trainer: Checkpointable, data_position: DataPosition, extra: dict[str, Any] | None) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temps()
        final = self.directory / f"step_{int(step)}"
        tmp = self.directory / f"{TMP_PREFIX}step_{int(step)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            trainer.save(tmp)
            check_finite_weights(tmp, step)
            import torch  # here, not at the top: what only reads YAML never pays its seconds of import

            torch.save(capture_rng_state(), tmp / RNG_FILE)
            state = {"format_version": FORMAT_VERSION, "step": int(step), "data_position": asdict(data_position), "extra": extra or {}}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))
            follow_umask(tmp)
            for f in tmp.iterdir():
                if f.is_file():
                    _fsync_file(f)
            _fsync_dir(tmp)
            if final.exists():
                trash = self.directory / f"{TMP_PREFIX}replaced-{final.name}-{uuid.uuid4().hex[:8]}"
                os.rename(final, trash)
                os.rename(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.rename(tmp, final)
            _fsync_dir(self.directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        atomic_write_text(self.directory / LATEST, final.name + "\n")
        _fsync_dir(self.directory)
        self._prune(keep_also=final)
        return final

    def restore(self, trainer: Checkpointable, path: str | os.PathLike | None = None) -> CheckpointState | None:
        """Load weights, optimizer and RNG states from `path` (default: the latest); None if there is none."""
        path = Path(path) if path is not None else self.latest()
        if path is None:
            return None
        state = read_state(path)
        trainer.load(path)
        rng_file = path / RNG_FILE
        if not rng_file.exists():
            raise GymvError("checkpoint has no RNG state", where=str(path),
                            fix="resume from a checkpoint written by gymv")
        import torch

        restore_rng_state(torch.load(rng_file, weights_only=True))
        return state

    def _remove_stale_temps(self) -> None:
        for child in self.directory.iterdir():
            if child.name.startswith(TMP_PREFIX) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)

    def _prune(self, keep_also: Path) -> None:
        if self.keep is None:
            return
        found = list_checkpoints(self.directory)
        for _, path in found[: max(0, len(found) - self.keep)]:
            if path != keep_also:
                # renamed first: a process killed mid-delete leaves a temp folder (removed by the next save),
                # never a half-deleted step_<N> that no longer reads as a checkpoint and is never pruned
                trash = self.directory / f"{TMP_PREFIX}pruned-{path.name}-{uuid.uuid4().hex[:8]}"
                os.rename(path, trash)
                shutil.rmtree(trash, ignore_errors=True)
