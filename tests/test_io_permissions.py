"""Files and folders gymv writes follow the umask, like any other tool's: teammates on a shared filesystem
can read a run written under umask 022, and a private umask keeps it private."""

from __future__ import annotations

import os
import stat

import pytest

from gymv.io import atomic_write_text, current_umask, write_jsonl
from gymv.runs.run_dir import RunDir


@pytest.fixture
def umask():
    old = os.umask(0o022)
    os.umask(old)

    def set_(mask: int) -> None:
        os.umask(mask)

    yield set_
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_current_umask_reads_the_process_umask(umask):
    umask(0o027)
    assert current_umask() == 0o027
    umask(0o002)
    assert current_umask() == 0o002


def test_atomic_write_under_umask_022_is_readable_by_everyone(umask, tmp_path):
    umask(0o022)
    atomic_write_text(tmp_path / "a.txt", "x")
    write_jsonl(tmp_path / "b.jsonl", [{"a": 1}])
    assert _mode(tmp_path / "a.txt") == 0o644
    assert _mode(tmp_path / "b.jsonl") == 0o644


def test_atomic_write_under_a_private_umask_stays_private(umask, tmp_path):
    umask(0o077)
    atomic_write_text(tmp_path / "a.txt", "x")
    assert _mode(tmp_path / "a.txt") == 0o600


def test_run_directory_files_follow_umask_027(umask, tmp_path):
    umask(0o027)
    run = RunDir.create(tmp_path / "run", {"algorithm": "sft", "name": "run"})
    with run.metrics_log() as log:
        log.log(1, {"train/loss": 1.0})
    path = run.write_rollouts(1, [{"reward": 1.0, "response": {"output": []}}])
    assert _mode(run.path) == 0o750
    assert _mode(run.config_path) == 0o640
    assert _mode(run.metrics_path) == 0o640
    assert _mode(path) == 0o640
    assert _mode(path.parent) == 0o750


def test_a_checkpoint_written_with_private_files_follows_umask_022(umask, tmp_path):
    from gymv.runs.checkpoint import CheckpointManager, DataPosition

    class PrivateWriter:  # writes the way safetensors does: a new file created 0600
        def save(self, path):
            fd = os.open(os.path.join(path, "model.safetensors"), os.O_WRONLY | os.O_CREAT, 0o600)
            os.close(fd)

        def load(self, path):
            pass

    umask(0o022)
    path = CheckpointManager(tmp_path / "checkpoints").save(1, PrivateWriter(), DataPosition())
    assert _mode(path) == 0o755
    assert _mode(path / "model.safetensors") == 0o644


@pytest.mark.slow
def test_an_initialised_model_folder_and_its_weights_follow_umask_022(umask, tmp_path):
    from gymv.models.tiny import init_tiny

    umask(0o022)
    out = tmp_path / "m"
    init_tiny("tiny-llava", out)
    assert _mode(out) == 0o755
    assert _mode(out / "model.safetensors") == 0o644
