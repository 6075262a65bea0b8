"""The `torch` training backend: a Hugging Face checkpoint trained by TorchTrainer (AdamW, token-budget
micro-batches) on one rank, with the multimodal collate, logprob and shared-prefix planning functions of
gymv.backends.logprobs. More ranks are `fsdp2` (hf_fsdp), which subclasses this backend."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gymv.backends import packed_attention, packed_mamba, step_images, vision_attention
from gymv.backends.hf_forward import has_recurrent_layers
from gymv.backends.logprobs import (
    MultimodalBatch,
    group_prefixes,
    packable,
    packed_prefixes,
    prefix_key,
    recomputes_activations,
    token_scores,
)
from gymv.backends.moe_router import RouterTerms
from gymv.backends.multimodal import hash_pictures
from gymv.backends.pixel_cache import pixel_cache
from gymv.backends.policy import load_policy
from gymv.backends.step_images import StepImages
from gymv.backends.training.base import LossFn, Sample, TrainingBackend, TrainingSetup
from gymv.backends.training.checkpointing import enable_checkpointing
from gymv.backends.training.compile import compile_layers
from gymv.backends.training.lr_schedule import lr_factor
from gymv.backends.training.micro_batches import (
    pad_collate,
    plan_micro_batches,
    plan_packed_micro_batches,
    plan_packed_shared_micro_batches,
    plan_shared_prefix_micro_batches,
    shared_prefix_cost,
)
from gymv.backends.training.samples import NON_TENSOR_FIELDS, as_tensors
from gymv.backends.training.torch_trainer import TorchTrainer
from gymv.errors import GymvError
from gymv.models.quiet import quiet_transformers

@dataclass(frozen=True)
class HostView:
    """A micro-batch's ids and masks in host memory, kept beside the copies the trainer moves to the device:
    packing, index building and placeholder checks read them here, so the host never waits on the device
    before a forward pass. `image_hashes`: the pictures' content hashes by id, from planning."""

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor | None
    image_hashes: dict[int, str] | None = None


HF_FILE_PREFIXES = ("config.json", "generation_config.json", "tokenizer", "special_tokens_map", "vocab", "merges",
                    "added_tokens", "chat_template", "processor_config", "preprocessor_config", "video_preprocessor")


def copy_hf_files(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Copy a checkpoint folder's config, tokenizer, processor and chat-template files (and remote code), so
    that a folder of trained weights loads with `from_pretrained` and as `model.path` of another run."""
    source, target = Path(source), Path(target)
    for f in source.iterdir():
        wanted = f.name.startswith(HF_FILE_PREFIXES) or f.suffix == ".py"
        if f.is_file() and wanted and not (target / f.name).exists():
            shutil.copy2(f, target / f.name)


class BatchLayout:
    """How one step's samples become micro-batches: padded rows (with each group's shared prompt run once where
    the model allows it) or packed rows (every micro-batch's real tokens in one row, no padding computed;
    with gymv's packed attention, each group's shared prompt once in the row).

    `packing`: True packs always (an adapter that cannot pack is refused here, at build time); False never;
    "auto" packs when it computes no more tokens than the padded shared-prefix plan would, which is always
    the case with packed attention (it shares prompts too) or when the model recomputes activations or is
    sharded (no shared-prefix cache there). The choice is made per step in `plan` and marked on each
    micro-batch by `collate` (`mb["packed"]`, and `mb["prefixes"]` where prompts are shared), read by the
    logprob function.
    """

    def __init__(self, adapter, model, pad_id: int, packing: bool | str = "auto"):
        # where packed attention is unsupported, transformers' dense packed mask confines attention instead
        # (1-D positions only), and prompts are not shared in a row
        installable = packed_attention.supports(model) is None
        why_not = packable(adapter, installable, model)
        if packing is True and why_not:
            raise GymvError(f"sequence packing is not supported for this model: {why_not}",
                            where="training.sequence_packing", fix="set training.sequence_packing: auto or false")
        self.adapter, self.model, self.pad_id = adapter, model, pad_id
        self.packing: bool | str = False if why_not else packing
        # a Mamba-2 layer restarts at each packed sequence and continues a shared prompt's state where its
        # mixers are transformers' (packed_mamba); padded, a recurrent model shares prompts of equal length only
        self.recurrent = has_recurrent_layers(model)
        vision_attention.install(model)  # a packed tower's images split without reading the device each block
        installed = self.packing is not False and packed_attention.install(model)
        self.shares_in_row = installed and (not self.recurrent or packed_mamba.continues_prompts(model))
        if installed and self.recurrent:
            packed_mamba.install(model)
        self.packed = False
        self._planned: dict[int, tuple] = {}  # id(sample) -> (sample, prefix key) of the last plan
        self._hashes: dict[int, str] = {}  # id(picture) -> content hash, of the last plan's pictures

    def _prefetch_pixels(self, samples) -> dict[int, str]:
        """Start preprocessing the step's pictures in the background (gymv.backends.pixel_cache); returns the
        pictures' content hashes by id, for the prefix keys."""
        pictures = list({id(im): im for s in samples for im in s.get("images") or ()}.values())
        hashes = hash_pictures(pictures)
        if pictures:
            pixel_cache(self.adapter).prefetch(self.adapter, pictures, [hashes[id(im)] for im in pictures])
        return hashes

    def _keys(self, samples, hashes: dict[int, str]) -> list:
        """Each sample's prefix key, remembered (with the sample) until the next plan, so that collating the
        planned micro-batches does not compute them again."""
        keys = [prefix_key(s["input_ids"], s["loss_mask"], s.get("images") or (), self.adapter.image_token_id, hashes)
                for s in samples]
        self._planned = {id(s): (s, k) for s, k in zip(samples, keys)}
        return keys

    def _planned_samples(self, samples) -> bool:
        """These are samples of the last plan (the same objects), so what it computed for them still holds."""
        found = [self._planned.get(id(s)) for s in samples]
        return all(f is not None and f[0] is s for f, s in zip(found, samples))

    def _known_keys(self, samples) -> list | None:
        if not self._planned_samples(samples):
            return None
        keys = [self._planned[id(s)][1] for s in samples]
        return None if any(k is None for k in keys) else keys

    def plan(self, samples, max_tokens: int) -> list[list[int]]:
        hashes = self._hashes = self._prefetch_pixels(samples)
        self._planned = {id(s): (s, None) for s in samples}  # `_keys` adds the prefix keys where computed
        lengths = [int(s["input_ids"].shape[0]) for s in samples]
        if self.packing is not False and self.shares_in_row:
            self.packed = True
            return plan_packed_shared_micro_batches(self._keys(samples, hashes), lengths, max_tokens)
        shares = not recomputes_activations(self.model) and not self.recurrent
        if self.packing is True or (self.packing == "auto" and not shares):
            self.packed = True
            return plan_packed_micro_batches(lengths, max_tokens)
        self.packed = False
        if not shares:
            return plan_micro_batches(lengths, max_tokens)
        keys = self._keys(samples, hashes)
        plan = plan_shared_prefix_micro_batches(keys, lengths, max_tokens)
        if self.packing == "auto" and sum(lengths) <= shared_prefix_cost(plan, keys, lengths):
            self.packed = True
            return plan_packed_micro_batches(lengths, max_tokens)
        return plan

    def step_images(self, model, samples, plan: list[list[int]]) -> StepImages | None:
        """The step's distinct images through the tower in one call (gymv.backends.step_images), or None: no
        gradient to take, the last micro-batch holds no image, more pixels than a step encodes at once, or an
        adapter whose features are not one tensor an image."""
        if not torch.is_grad_enabled() or not plan or not any(samples[i].get("images") for i in plan[-1]):
            return None
        every = [im for s in samples for im in s.get("images") or ()]
        hashes = hash_pictures(every, dict(self._hashes))
        pictures: dict = {}
        for im in every:
            pictures.setdefault(hashes[id(im)], im)
        dev = next(model.parameters()).device
        inputs = pixel_cache(self.adapter).inputs(self.adapter, list(pictures.values()), list(pictures),
                                                  pin=dev.type == "cuda")
        pixels = inputs.pixel_values
        if not isinstance(pixels, Tensor) or pixels.numel() > step_images.MAX_PIXEL_VALUES:
            return None
        feats = self.adapter.image_features(model, inputs)
        if not all(isinstance(f, Tensor) for f in feats):
            return None
        return StepImages(model, list(pictures), feats, inputs.image_grid_thw)

    def collate(self, samples):
        tensors = [{k: v for k, v in s.items() if k not in NON_TENSOR_FIELDS} for s in samples]
        mb = pad_collate(tensors, pad_values={"input_ids": self.pad_id})
        mb["images"] = [list(s.get("images") or ()) for s in samples]
        mb["where"] = [s.get("where") for s in samples]
        planned = self._planned_samples(samples)
        hashes = None
        if planned:  # the planned samples' pictures: their ids still name the pictures that were hashed
            hashes = {id(im): self._hashes[id(im)] for row in mb["images"] for im in row if id(im) in self._hashes}
        mb["host"] = HostView(mb["input_ids"], mb["attention_mask"], mb.get("loss_mask"), hashes)
        if self.packed:
            mb["packed"] = True
            if self.shares_in_row and "loss_mask" in mb:
                keys = [self._planned[id(s)][1] for s in samples] if planned else None
                keys = None if keys is None or any(k is None for k in keys) else keys
                mb["prefixes"] = group_prefixes(keys) if keys is not None else packed_prefixes(
                    mb["input_ids"], mb["loss_mask"], mb["images"], self.adapter.image_token_id)
        return mb


def logprob_fn(adapter, temperature: float, forbidden_ids=None):
    """`forbidden_ids` None: the adapter's vision tokens (the policy's distribution); () scores raw logits."""

    def fn(model, mb):
        """Scores the loss-masked tokens only (every loss reads logprobs there alone); other entries are 0.
        With a teacher's top-k candidates in the batch, also the student's logprobs of them."""
        host = mb.get("host")
        if host is not None:
            batch = MultimodalBatch(host.input_ids, host.attention_mask, mb["images"], mb["where"],
                                    image_hashes=host.image_hashes)
            score_mask = host.loss_mask
        else:
            batch = MultimodalBatch(mb["input_ids"], mb["attention_mask"], mb["images"], mb["where"])
            score_mask = mb.get("loss_mask")
        return token_scores(model, adapter, batch, temperature, forbidden_ids, entropy=True, score_mask=score_mask,
                            gather_ids=mb.get("teacher_topk_ids"), packed=bool(mb.get("packed")),
                            prefixes=mb.get("prefixes"))

    return fn


class HFTorchBackend(TrainingBackend):
    """The policy under training and, for a KL penalty, a frozen reference (one rank; its subclasses: one rank
    of several)."""

    trainer_class: type[TorchTrainer] = TorchTrainer  # one rank; a multi-rank subclass names its own

    def __init__(self, policy, setup: TrainingSetup, *, device: Any, rank: int = 0, world_size: int = 1):
        self.setup, self.policy = setup, policy
        self.rank, self.world_size = rank, world_size
        self.tokenizer, self.adapter, self.chat_template = policy.tokenizer, policy.adapter, policy.chat_template
        model = policy.model
        if setup.training.gradient_checkpointing:
            enable_checkpointing(model, vision=setup.training.vision_checkpointing)
        self.pad_id = policy.tokenizer.pad_token_id or 0
        self.logprob_fn = logprob_fn(policy.adapter, setup.temperature)
        self.router_terms = RouterTerms.attach(model, setup.training.moe)
        self.config = setup.training
        self.trainer = self._make_trainer(model, device)
        self.reference = self._make_reference(device) if setup.kl_reference else None

    def _make_reference(self, device):
        """The frozen KL reference's trainer: the checkpoint loaded again."""
        ref = load_policy(self.setup.model_path, device=str(device), dtype=self.reference_dtype(), seed=self.setup.seed,
                          trust_remote_code=self.setup.trust_remote_code).model
        return self._make_trainer(ref, device, frozen=True)

    def reference_dtype(self) -> torch.dtype:
        """The dtype the KL reference is held in: float32, as the policy's master weights."""
        return torch.float32

    def _make_trainer(self, model, device, *, frozen: bool = False):
        if frozen:
            model.requires_grad_(True)  # TorchTrainer refuses a model without trainable parameters; never stepped
        layout = self.layout(model)
        self.compile_layers(model, frozen)
        return self.trainer_class(model, self.trainer_logprob_fn(frozen), self.config, collate_fn=layout.collate,
                                  device=device, plan_fn=layout.plan, images_fn=layout.step_images)

    def trainer_logprob_fn(self, frozen: bool):
        """The logprob function of a trainer; the policy's records its MoE routers (training.moe)."""
        if frozen or self.router_terms is None:
            return self.logprob_fn
        return self.router_terms.wrap_logprob(self.logprob_fn)

    def compile_layers(self, model, frozen: bool) -> None:
        """training.compile: the policy's decoder layers compiled (after the layout switched its attention,
        before sharding); the frozen reference stays eager."""
        compile_ = self.setup.training.compile
        if compile_ and not frozen:
            compile_layers(model, **({"backend": compile_} if isinstance(compile_, str) else {}))

    def layout(self, model) -> BatchLayout:
        return BatchLayout(self.adapter, model, self.pad_id, self.setup.training.sequence_packing)

    @classmethod
    def create(cls, setup: TrainingSetup, *, device: Any, rank: int = 0, world_size: int = 1) -> HFTorchBackend:
        policy = load_policy(setup.model_path, device=str(device), dtype=torch.float32, seed=setup.seed,
                             trust_remote_code=setup.trust_remote_code)
        return cls(policy, setup, device=device, rank=rank, world_size=world_size)

    @property
    def model(self) -> torch.nn.Module:
        return self.trainer.model

    @property
    def steps(self) -> int:
        return self.trainer.steps

    def learning_rate(self, step: int) -> float:
        t = self.setup.training
        return self.config.lr * lr_factor(step, warmup_steps=t.warmup_steps, total_steps=self.setup.total_steps,
                                          schedule=t.lr_schedule, min_ratio=t.min_lr_ratio,
                                          warmup_init_ratio=t.warmup_init_ratio)

    def train_step(self, samples: Sequence[Sample], loss_fn: LossFn) -> dict[str, float]:
        samples = [as_tensors(s) for s in samples]
        lr = self.learning_rate(self.trainer.steps + 1)
        for g in self.trainer.optimizer.param_groups:
            g["lr"] = lr
        if self.router_terms is None:
            return self.trainer.train_step(samples, loss_fn)
        out = self.trainer.train_step(samples, self.router_terms.wrap_loss(loss_fn))
        return {**out, **self.router_terms.end_step(self.trainer.ranks.sum_)}

    def compute_logprobs(self, samples: Sequence[Sample], *, reference: bool = False) -> list[Tensor]:
        trainer = self.reference if reference else self.trainer
        if trainer is None:
            raise RuntimeError("reference logprobs asked of a backend built without kl_reference")
        return trainer.compute_logprobs([as_tensors(s) for s in samples])

    def probe_logprobs(self, sample: Sample) -> Tensor:
        """Raw logprobs (temperature 1, nothing masked) of the sample's loss-masked tokens: the trainer's side of
        the refit probe. The policy's logprob function is swapped for the raw one for this call alone."""
        trainer, own = self.trainer, self.trainer.logprob_fn
        trainer.logprob_fn = logprob_fn(self.adapter, 1.0, ())
        try:
            return self.compute_logprobs([sample])[0]
        finally:
            trainer.logprob_fn = own

    @property
    def has_reference(self) -> bool:
        return self.reference is not None

    def sum_over_ranks(self, value: float) -> float:
        return float(self.trainer.ranks.sum_(torch.tensor([float(value)], device=self.trainer.device)))

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        yield from self.trainer.state_dict().items()

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.trainer.model.parameters())

    def checkpoint_bytes(self) -> int:
        return self.trainer.checkpoint_bytes() if self.rank == 0 else 0

    def save(self, path: str | os.PathLike) -> None:
        """Rank 0 writes weights, optimizer and the HF files (the folder then loads as a model)."""
        if self.rank == 0:
            self.trainer.save(path)
            copy_hf_files(self.setup.model_path, path)

    def load(self, path: str | os.PathLike) -> None:
        self.trainer.load(path)

    def export_hf(self, path: str | os.PathLike) -> None:
        if self.rank != 0:
            return
        with quiet_transformers():
            self.trainer.model.save_pretrained(path)
        copy_hf_files(self.setup.model_path, path)
