"""A Megatron rank reads only its shard of an HF checkpoint: the tiny Nemotron 3 Omni at TP2 x EP2 reads its
TP slices, its own experts and the vision tower, no other rank's experts, and builds exactly the model (state
dict and logprobs) that loading the whole checkpoint builds; so do a dense decoder at TP2 from a checkpoint
split over several safetensors files, and its KL reference. The checkpoint is read under the model's names through transformers'
own renamings and converters, and one without safetensors, or whose tensors do not fill the model, is refused
naming its folder."""

import copy
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("megatron.core")

from gymv.backends.checkpoint_files import CheckpointFiles  # noqa: E402
from gymv.backends.model_weights import ModelWeights  # noqa: E402
from gymv.backends.policy import load_policy  # noqa: E402
from gymv.backends.training.hf_torch import copy_hf_files  # noqa: E402
from gymv.backends.training.process_group import leave_process_group  # noqa: E402
from gymv.errors import GymvError  # noqa: E402
from megatron_helpers import spawn_ranks  # noqa: E402
from tiny_models import tiny_path  # noqa: E402

LAYOUTS = {"omni": {"tensor": 2, "expert": 2}, "dense": {"tensor": 2}}
EXPERTS = "language_model.backbone.layers.{}.mixer.experts.{}."


def _setup(path: str, sizes: dict, kl_reference: bool = False):
    from gymv.backends.training.base import TrainingSetup
    from gymv.config.schema import ParallelSection, TrainingSection

    return TrainingSetup(model_path=path, training=TrainingSection(dtype="float32", parallel=ParallelSection(**sizes)),
                         kl_reference=kl_reference)


def _rank(rank, world, port, paths):
    """Each layout built twice on this rank, from its shard of the checkpoint and from the whole checkpoint
    loaded as before: their twins' states and logprobs, and what the shard reading read."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from gymv.backends.training.megatron import MegatronBackend
    from test_megatron_model import _image_samples
    from tiny_lm import make_samples

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = {}
        for name, sizes in LAYOUTS.items():
            setup = _setup(paths[name], sizes, kl_reference=name == "dense")
            sharded = MegatronBackend.create(setup, device="cpu", rank=rank, world_size=world)
            whole = MegatronBackend(load_policy(paths[name], dtype=torch.float32), setup, device="cpu", rank=rank,
                                    world_size=world)
            samples = _image_samples(sharded.policy, n=2) if name == "omni" else make_samples(3, seed=1)
            states = [{k: v for k, v in b.trainer.model.state_dict().items() if isinstance(v, torch.Tensor)}
                      for b in (sharded, whole)]
            result[name] = {
                "differ": sorted(k for k in states[1] if k not in states[0] or not torch.equal(states[0][k], states[1][k])),
                "logprobs": [b.compute_logprobs(copy.deepcopy(samples)) for b in (sharded, whole)],
                "reads": sharded.checkpoint_reads,
                "decoder_bytes": sum(v.numel() * v.element_size() for k, v in states[0].items() if k.startswith("gpt.")),
                "ep_rank": parallel_state.get_expert_model_parallel_rank(),
            }
            if setup.kl_reference:
                result[name]["reference"] = sharded.compute_logprobs(copy.deepcopy(samples), reference=True)
            parallel_state.destroy_model_parallel()
        return result
    finally:
        leave_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    split = tmp_path_factory.mktemp("split") / "qwen3"  # the tiny dense decoder over four safetensors files
    load_policy(tiny_path("tiny-qwen3"), dtype=torch.float32).model.save_pretrained(split, max_shard_size="1MB")
    copy_hf_files(tiny_path("tiny-qwen3"), split)
    paths = {"omni": str(tiny_path("tiny-nemotron-omni")), "dense": str(split)}
    return paths, spawn_ranks(_rank, 2, paths)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_rank_built_from_its_shard_holds_exactly_the_whole_checkpoints_model(layout, ranks):
    for got in ranks[1]:
        assert got[layout]["differ"] == []
        for a, b in zip(*got[layout]["logprobs"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.slow
def test_a_tp2_ep2_rank_reads_its_tp_slices_its_experts_and_the_vision_tower_alone(ranks):
    paths, results = ranks
    files = CheckpointFiles(paths["omni"])
    whole = {name: files.nbytes(name) for name in files}
    outside = sum(n for name, n in whole.items() if not name.startswith("language_model."))
    for got in results:
        reads, ep = got["omni"]["reads"], got["omni"]["ep_rank"]
        # what the rank holds of the decoder, and the vision tower and projector whole: nothing more
        assert sum(reads.values()) == got["omni"]["decoder_bytes"] + outside < sum(whole.values())
        for layer in (1, 3):
            for expert in range(4):
                read = [n for name, n in reads.items() if name.startswith(EXPERTS.format(layer, expert))]
                assert (len(read) == 2) == (expert // 2 == ep)  # up and down projections of its own two
        for name in ("language_model.backbone.embeddings.weight", "language_model.lm_head.weight",
                     "language_model.backbone.layers.2.mixer.q_proj.weight",
                     "language_model.backbone.layers.0.mixer.in_proj.weight"):
            assert reads[name] == whole[name] // 2, name
        assert reads["vision_model.radio_model.model.blocks.0.attn.qkv.weight"] == whole[
            "vision_model.radio_model.model.blocks.0.attn.qkv.weight"]


@pytest.mark.slow
def test_the_kl_reference_is_read_from_the_checkpoint_as_the_policy_is(ranks):
    for got in ranks[1]:
        for a, b in zip(got["dense"]["reference"], got["dense"]["logprobs"][1], strict=True):
            assert torch.equal(a, b)


@pytest.mark.slow
def test_a_checkpoint_split_over_several_files_is_read_through_its_index(ranks):
    paths, results = ranks
    assert len(CheckpointFiles(paths["dense"]).shards()) == 4
    for got in results:
        assert got["dense"]["reads"] and got["dense"]["differ"] == []


def test_the_checkpoint_is_read_under_the_models_names_through_transformers_converters():
    """Nemotron-H's experts are stored one by one and stacked; RADIO's qkv is stored fused and split."""
    path = tiny_path("tiny-nemotron-omni")
    full = load_policy(path, dtype=torch.float32).model.state_dict()
    files = CheckpointFiles(path)
    weights = ModelWeights(files, load_policy(path, dtype=torch.float32, skeleton=True).model)
    experts = "language_model.model.layers.1.mixer.experts.up_proj"
    assert torch.equal(weights.read(experts, (slice(2, 4),)), full[experts][2:4])
    assert sorted(files.read_bytes) == [EXPERTS.format(1, e) + "up_proj.weight" for e in (2, 3)]
    assert sorted(weights) == sorted(full)
    for name, tensor in full.items():
        assert torch.equal(weights[name], tensor), name


def test_a_checkpoint_without_safetensors_is_refused_naming_its_folder(tmp_path):
    from gymv.backends.training.megatron import shard_source

    source = tiny_path("tiny-qwen3")
    copy_hf_files(source, tmp_path)
    torch.save(load_file(str(source / "model.safetensors")), tmp_path / "pytorch_model.bin")
    with pytest.raises(GymvError) as e:
        shard_source(tmp_path)
    assert e.value.where == str(tmp_path) and "pytorch_model.bin" in e.value.message and "safetensors" in e.value.fix


def test_a_checkpoint_lacking_a_decoder_tensor_is_refused_naming_it(tmp_path):
    from gymv.backends.training.megatron import shard_source

    source = tiny_path("tiny-qwen3")
    copy_hf_files(source, tmp_path)
    state = load_file(str(source / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(GymvError) as e:
        shard_source(tmp_path)
    assert e.value.where == str(tmp_path) and "model.layers.1.mlp.down_proj.weight" in e.value.message


def test_a_folder_of_model_tensors_reads_one_slice_and_logs_its_bytes(tmp_path):
    shutil.copy(tiny_path("tiny-qwen3") / "model.safetensors", tmp_path)
    files = CheckpointFiles(tmp_path)
    name = "model.embed_tokens.weight"
    rows = files.shape(name)[0]
    part = files.read(name, (slice(rows // 2, rows),))
    assert torch.equal(part, load_file(str(tmp_path / "model.safetensors"))[name][rows // 2:])
    assert files.read_bytes == {name: files.nbytes(name) // 2}
