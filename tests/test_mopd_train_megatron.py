"""`gymv train` MOPD in Megatron on a real local Ray: the tiny LLaVA student trains over two tensor-parallel
CPU ranks and distils from a tiny LLaVA teacher whose replica is two tensor-parallel ranks (one Ray actor each,
gloo). The same run with the torch teacher and the torch trainer scores the same rows alike and takes the same
steps (float32)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

from gymv.envs.mix import MixPart, write_mixed_dataset  # noqa: E402
from gymv.train import train  # noqa: E402
from tiny_models import tiny_path  # noqa: E402
from train_helpers import ray_session, write_recipe  # noqa: E402

pytestmark = pytest.mark.slow
STEPS = 2


@pytest.fixture(scope="module", autouse=True)
def ray():
    stop = ray_session()
    yield
    stop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from gymv.models.tiny import init_tiny

    tmp = tmp_path_factory.mktemp("mopd-megatron")
    data = {split: tmp / f"{split}.jsonl" for split in ("train", "eval")}
    for split, path in data.items():
        write_mixed_dataset(path, [MixPart("circle-count", "tiny", 4)], split=split)
    teacher = tmp / "teacher"
    init_tiny("tiny-llava", teacher, hidden=64, layers=1)  # the student's tokenizer, other weights
    out = {}
    megatron_teacher = {"backend": "megatron", "tensor_parallel_size": 2, "placement": "separate"}
    runs = (("torch", {}, {}),
            ("megatron", megatron_teacher, {"training.backend": "megatron", "training.parallel.tensor": 2,
                                            "cluster.cpu_training_ranks": 2}))
    for name, extra, student in runs:
        settings = {
            "model.path": str(tiny_path("tiny-llava")), "model.max_seq_len": 256,
            "env.name": "circle-count", "env.max_turns": 1,
            "data.train": str(data["train"]), "data.eval": str(data["eval"]), "data.prepare": None,
            "generation.max_new_tokens": 6, "training.lr": 1.0e-3, "training.dtype": "float32",
            "mopd.prompts_per_step": 2, "mopd.max_steps": STEPS, "mopd.val_period": 0,
            "mopd.teachers": {"_override_": True, "teacher": {"path": str(teacher), **extra}},
            "checkpoint.dir": str(tmp / "runs"), "checkpoint.period": STEPS, "cluster.ray_address": None, **student,
        }
        summary = train(write_recipe(tmp, f"mopd-{name}", "vlm/vlm_mopd-tinyllava-1n0g-torch.yaml", settings))
        lines = (tmp / "runs" / f"mopd-{name}" / "metrics.jsonl").read_text().splitlines()
        out[name] = (summary, [json.loads(line) for line in lines])
    return out


def test_a_mopd_run_with_a_tensor_parallel_megatron_teacher_completes(runs):
    summary, rows = runs["megatron"]
    assert summary["complete"] and [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["train/num_teacher_batches"] == 1  # one replica (of two ranks) scored each step
        assert abs(r["train/kl_teacher/teacher"]) > 1e-3  # another model than the student scored


def test_its_teacher_scores_and_the_students_steps_equal_the_torch_runs(runs):
    """The same rows (the first batch is sampled by the same weights): the teacher's advantages and KL, and
    the student's losses and gradient norms, equal the torch teacher's and torch trainer's."""
    (_, megatron), (_, torch_) = runs["megatron"], runs["torch"]
    assert len(megatron) == len(torch_) == STEPS
    for m, t in zip(megatron, torch_):
        for key in ("train/teacher_advantage", "train/teacher_advantage_min", "train/teacher_advantage_max",
                    "train/kl_teacher/teacher", "train/loss", "train/grad_norm"):
            assert m[key] == pytest.approx(t[key], rel=1e-4, abs=1e-5), key
        assert m["train/token_mult_prob_error"] < 1.05  # the gathered refit reached the generator


def test_a_megatron_teacher_on_gpus_asks_one_bundle_a_replica_and_one_gpu_a_rank():
    from ray.util.placement_group import remove_placement_group

    from gymv.cluster.teachers import replica_options
    from gymv.config import load_recipe
    from train_helpers import REPO

    teacher = ("{t: {path: embedded:tiny-llava, backend: megatron, placement: separate, data_parallel_size: 2, "
               "tensor_parallel_size: 2, gpus: 4}}")
    cfg = load_recipe(REPO / "recipes/vlm/vlm_mopd-tinyllava-1n0g-torch.yaml", [
        "cluster.gpus_per_node=8", "training.backend=fsdp2", "mopd.prompts_per_step=8", f"mopd.teachers={teacher}",
        "mopd.agent_to_teacher={circle_count_simple_agent: t}", "cluster.colocated=false",
        "cluster.generation_gpus=2", "cluster.training_gpus=2"]).validated
    opts, pg = replica_options(cfg, "t")
    try:
        assert pg.bundle_specs == [{"GPU": 2.0, "CPU": 2.0}] * 2  # a replica's ranks never span nodes
        assert [o["num_gpus"] for o in opts] == [1, 1, 1, 1]
        assert [o["scheduling_strategy"].placement_group_bundle_index for o in opts] == [0, 0, 1, 1]
    finally:
        remove_placement_group(pg)
