"""Atomic checkpoints: layout, latest pointer, pruning, exact resume, and crashes in the middle of a save."""

import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from gymv.algorithms.loss_fns import PolicyLoss
from gymv.backends.training.torch_trainer import TorchTrainer
from gymv.errors import GymvError
from gymv.runs.checkpoint import CheckpointManager, DataPosition, find_latest, list_checkpoints, read_state
from gymv.sections import TrainingSection
from tiny_lm import logprob_fn, make_samples, tiny_lm

TESTS = Path(__file__).resolve().parent
CONFIG = TrainingSection(lr=1e-2, micro_batch_tokens=24)


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def new_trainer(seed=0):
    return TorchTrainer(tiny_lm(seed), logprob_fn, CONFIG)


def train(trainer, steps):
    """Each step draws its data from all three global RNGs, so a resume must restore every one of them."""
    for _ in range(steps):
        samples = make_samples(4, seed=int(torch.randint(0, 10**6, (1,))))
        samples[0]["advantages"] = torch.tensor(random.random() + float(np.random.rand()))
        trainer.train_step(samples, PolicyLoss())


def draws():
    return (random.random(), float(np.random.rand()), float(torch.rand(())))


def test_a_checkpoint_holds_weights_optimizer_rng_and_state(tmp_path):
    t = new_trainer()
    path = CheckpointManager(tmp_path / "checkpoints").save(3, t, DataPosition(epoch=1, index=40, shuffle_seed=7), {"best": 0.5})
    assert path.name == "step_3"
    assert {"model.safetensors", "optimizer.pt", "rng.pt", "state.json"} <= {p.name for p in path.iterdir()}
    state = read_state(path)
    assert (state.step, state.data_position, state.extra) == (3, DataPosition(1, 40, 7), {"best": 0.5})
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_3"


def test_resumed_training_is_identical_to_uninterrupted_training(tmp_path):
    seed_all(0)
    straight = new_trainer()
    train(straight, 4)
    expected_draws = draws()

    seed_all(0)
    first = new_trainer()
    train(first, 2)
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(2, first, DataPosition(index=8))
    seed_all(12345)  # a new process would start from unrelated RNG states and weights
    resumed = new_trainer(seed=99)
    state = manager.restore(resumed)
    train(resumed, 2)

    assert state.step == 2 and state.data_position.index == 8
    for k, v in straight.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    assert draws() == expected_draws


def test_keep_prunes_all_but_the_last_k(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", keep=2)
    t = new_trainer()
    for step in (1, 2, 3, 4):
        manager.save(step, t, DataPosition())
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [3, 4]


def test_find_latest_ignores_temp_dirs_and_accepts_the_run_dir(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(5, new_trainer(), DataPosition())
    (tmp_path / "checkpoints" / ".tmp-step_9-deadbeef").mkdir()
    (tmp_path / "checkpoints" / ".tmp-step_9-deadbeef" / "model.safetensors").write_bytes(b"partial")
    assert find_latest(tmp_path) == tmp_path / "checkpoints" / "step_5"
    assert find_latest(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step_5"


def test_no_checkpoint_means_nothing_to_restore(tmp_path):
    assert find_latest(tmp_path) is None
    assert CheckpointManager(tmp_path / "checkpoints").restore(new_trainer()) is None


def test_an_exception_during_save_leaves_the_previous_checkpoint_and_no_temp(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    good = new_trainer()
    manager.save(1, good, DataPosition())

    class FailsAfterWritingWeights(TorchTrainer):
        def save(self, path):
            super().save(path)
            raise OSError("disk full")

    failing = FailsAfterWritingWeights(tiny_lm(3), logprob_fn, CONFIG)
    with pytest.raises(OSError, match="disk full"):
        manager.save(2, failing, DataPosition())
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()] == ["step_1"]
    assert find_latest(tmp_path) == tmp_path / "checkpoints" / "step_1"


CRASHING_CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch
    from gymv.algorithms.loss_fns import PolicyLoss
    from gymv.backends.training.torch_trainer import TorchTrainer
    from gymv.runs.checkpoint import CheckpointManager, DataPosition
    from gymv.sections import TrainingSection
    from tiny_lm import logprob_fn, make_samples, tiny_lm

    class KilledMidSave(TorchTrainer):
        kill = False
        def save(self, path):
            super().save(path)  # weights and optimizer are written; rng.pt and state.json are not
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)

    t = KilledMidSave(tiny_lm(0), logprob_fn, TrainingSection(lr=1e-2))
    manager = CheckpointManager({ckpt!r})
    t.train_step(make_samples(4, seed=1), PolicyLoss())
    manager.save(1, t, DataPosition(index=4))
    torch.save(t.state_dict(), {weights!r})
    t.train_step(make_samples(4, seed=2), PolicyLoss())
    t.kill = True
    manager.save(2, t, DataPosition(index=8))
""")


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    ckpt, weights = tmp_path / "run" / "checkpoints", tmp_path / "step1_weights.pt"
    script = CRASHING_CHILD.format(tests=str(TESTS), ckpt=str(ckpt), weights=str(weights))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert any(p.name.startswith(".tmp-step_2") for p in ckpt.iterdir())  # the half-written save is there...
    assert find_latest(tmp_path / "run") == ckpt / "step_1"  # ...and ignored
    assert (ckpt / "latest").read_text().strip() == "step_1"
    fresh = new_trainer(seed=7)
    state = CheckpointManager(ckpt).restore(fresh)
    assert (state.step, state.data_position.index, fresh.steps) == (1, 4, 1)
    saved = torch.load(weights, weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())


def test_a_prune_interrupted_mid_delete_leaves_no_half_deleted_checkpoint(tmp_path, monkeypatch):
    """A SIGKILL inside the delete of an old checkpoint (seen in the kill-and-resume test) must not leave a
    step_<N> folder without its state.json, which would never read as a checkpoint and never be pruned."""
    import shutil

    d = tmp_path / "checkpoints"
    manager = CheckpointManager(d, keep=1)
    t = new_trainer()
    manager.save(1, t, DataPosition())

    def killed_midway(path, ignore_errors=False):
        (Path(path) / "state.json").unlink()  # the delete got this far
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        manager.save(2, t, DataPosition())
    monkeypatch.undo()
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("step_")) == ["step_2"]
    manager.save(3, t, DataPosition())  # the next save clears the interrupted delete's leftovers
    assert sorted(p.name for p in d.iterdir()) == ["latest", "step_3"]


def test_the_next_save_clears_a_crashed_saves_temp_dir(tmp_path):
    stale = tmp_path / "checkpoints" / ".tmp-step_2-0badf00d"
    stale.mkdir(parents=True)
    CheckpointManager(tmp_path / "checkpoints").save(2, new_trainer(), DataPosition())
    assert not stale.exists()


def test_saving_a_step_again_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(2, new_trainer(), DataPosition(index=1))
    manager.save(2, new_trainer(), DataPosition(index=2))
    assert read_state(find_latest(tmp_path)).data_position.index == 2


def test_keep_below_one_is_a_config_error(tmp_path):
    with pytest.raises(GymvError, match="keep"):
        CheckpointManager(tmp_path, keep=0)


def test_read_state_of_an_incomplete_dir_is_an_error(tmp_path):
    with pytest.raises(GymvError, match="not a complete checkpoint"):
        read_state(tmp_path)


# -- a disk that refuses the checkpoint ----------------------------------------------------------------


@pytest.fixture
def small_disk(tmpfs):
    return tmpfs("4m")


def fill(disk: Path) -> Path:
    """Take every free byte of the disk; returns the filler file."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


def test_a_full_disk_is_a_write_error_naming_the_cause_and_the_earlier_checkpoint_survives(small_disk):
    from gymv.errors import WriteError

    mgr, t = CheckpointManager(small_disk / "run" / "checkpoints"), new_trainer()
    first = mgr.save(1, t, DataPosition())
    fill(small_disk)
    with pytest.raises(WriteError) as e:
        mgr.save(2, t, DataPosition())
    assert "No space left on device" in e.value.message and "free disk space" in e.value.fix
    assert "learning rate" not in e.value.one_line()
    assert list_checkpoints(mgr.directory) == [(1, first)] and find_latest(mgr.directory) == first
    assert not [p for p in mgr.directory.iterdir() if p.name.startswith(".tmp-")]


def test_a_refused_checkpoint_is_tried_again_and_saved_once_space_is_freed(small_disk):
    mgr, t = CheckpointManager(small_disk / "run" / "checkpoints"), new_trainer()
    filler = fill(small_disk)
    said: list[str] = []

    def free_space(text: str) -> None:  # the user clears the disk while gymv waits
        said.append(text)
        filler.unlink()

    path = mgr.save_retrying(5, t, DataPosition(), wait_s=0.0, say=free_space)
    assert path.name == "step_5" and read_state(path).step == 5
    assert len(said) == 1 and "kept in memory, trying again" in said[0]


def test_a_checkpoint_refused_twice_stops_with_the_cause_and_the_resume_command(small_disk):
    from gymv.errors import WriteError

    mgr, t = CheckpointManager(small_disk / "run" / "checkpoints"), new_trainer()
    mgr.save(1, t, DataPosition())
    fill(small_disk)
    with pytest.raises(WriteError) as e:
        mgr.save_retrying(2, t, DataPosition(), wait_s=0.0)
    assert "could not be written, twice: " in e.value.message and "No space left" in e.value.message
    assert f"from step_1, the newest complete checkpoint: gymv train --resume {small_disk / 'run'}" in e.value.fix
    assert e.value.exit_code == 1


def test_a_read_only_checkpoint_folder_is_a_write_error_naming_it(small_disk):
    from gymv.errors import WriteError

    mgr, t = CheckpointManager(small_disk / "run" / "checkpoints"), new_trainer()
    mgr.save(1, t, DataPosition())
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    try:
        with pytest.raises(WriteError) as e:
            mgr.save(2, t, DataPosition())
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    assert "Read-only file system" in e.value.message and e.value.where == str(mgr.directory / "step_2")
    assert "writable" in e.value.fix


_SHARDED_SAVE = textwrap.dedent("""
    import sys
    sys.path.insert(0, "tests")
    from gymv.backends.training.fsdp import FSDPTrainer
    from gymv.errors import GymvError
    from gymv.runs.checkpoint import CheckpointManager, DataPosition
    from gymv.sections import TrainingSection
    from tiny_lm import logprob_fn, tiny_lm
    trainer = FSDPTrainer(tiny_lm(), logprob_fn, TrainingSection(dtype="float32"))
    try:
        CheckpointManager(sys.argv[1]).save(1, trainer, DataPosition())
    except GymvError as e:
        print("ERROR " + e.one_line())
""")


@pytest.mark.slow
def test_a_sharded_checkpoint_that_fills_the_disk_is_a_write_error_naming_the_cause(small_disk):
    """torch.distributed.checkpoint wraps a rank's failed write in a BaseException whose text ("unexpected pos
    704 vs 598") names no cause; a 7B run's checkpoint that filled its disk stopped with only that."""
    fill(small_disk)
    folder = small_disk / "run" / "checkpoints"
    out = subprocess.run([sys.executable, "-c", _SHARDED_SAVE, str(folder)], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    line = next((l for l in out.stdout.splitlines() if l.startswith("ERROR ")), out.stderr[-2000:])
    assert f"{folder / 'step_1'}: cannot write: No space left on device (fix: free disk space)" in line
    assert not [p for p in folder.iterdir() if p.name.startswith(".tmp-")]


def test_a_short_write_reported_without_an_errno_reads_as_a_full_disk_only_when_the_disk_is_full(tmpfs):
    from gymv.io import LOW_SPACE_BYTES, as_write_failure

    disk = tmpfs(f"{2 * LOW_SPACE_BYTES // 2**20}m")
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # torch's zip writer
    assert as_write_failure(short, disk / "x") is None  # room left: some other fault, left as it is
    fill(disk)
    refused = as_write_failure(short, disk / "x")
    assert refused is not None and refused.strerror == "No space left on device"


def test_a_checkpoint_bigger_than_the_free_space_is_told_at_the_launch_with_the_fix(small_disk):
    from gymv.runs.checkpoint import disk_room_warning

    said = disk_room_warning(small_disk / "run" / "checkpoints", 8 * 10**6, keep=2)  # 8 MB on a 4 MB disk
    assert said is not None and "about 0.0 GB" not in said and "the next checkpoint will not be written" in said
    assert str(small_disk) in said and "checkpoint.enabled: false" in said


def test_room_for_one_checkpoint_but_not_for_those_kept_at_once_is_told_too(small_disk):
    from gymv.runs.checkpoint import disk_room_warning

    said = disk_room_warning(small_disk / "run" / "checkpoints", 2 * 10**6, keep=2)  # 3 x 2 MB on a 4 MB disk
    assert said is not None and "up to 3 are on disk at once" in said and "a later checkpoint will not fit" in said
    assert disk_room_warning(small_disk / "run" / "checkpoints", 10**6, keep=2) is None  # 3 x 1 MB fit


def test_checkpoints_already_on_the_disk_count_as_taken_room(small_disk):
    from gymv.runs.checkpoint import disk_room_warning

    mgr, t = CheckpointManager(small_disk / "run" / "checkpoints", keep=2), new_trainer()
    mgr.save(1, t, DataPosition())
    mgr.save(2, t, DataPosition())
    one = sum(f.stat().st_size for f in (mgr.directory / "step_2").rglob("*") if f.is_file())
    free = shutil.disk_usage(small_disk).free
    assert disk_room_warning(mgr.directory, min(free, one), keep=2) is None  # a third needs room for one only


def test_a_trainers_checkpoint_size_is_known_before_its_first_step_and_matches_what_it_writes(tmp_path):
    t = new_trainer()
    before = t.checkpoint_bytes()
    train(t, 1)
    assert t.checkpoint_bytes() == before  # the moments the first step creates were counted
    t.save(tmp_path)
    written = (tmp_path / "model.safetensors").stat().st_size + (tmp_path / "optimizer.pt").stat().st_size
    tensors = len(t.model.state_dict()) + 3 * len(t.params)  # weights; two moments and a count each
    assert before <= written < before + 1024 * tensors  # the files add their headers, under 1 KB a tensor
