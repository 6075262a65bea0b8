"""A second generation backend and a second training backend for the registry tests: each wraps the
built-in one and reaches it through the public interface only (no attribute passes through), so a worker
that needed anything beyond the interface would fail with them. Each leaves a mark next to the model
folder (`<model>.<kind>-backend.<pid>`), which tells a test that the run built it, in which process."""

from __future__ import annotations

import os
from pathlib import Path

from gymv.backends.generation.base import GenerationBackend
from gymv.backends.generation.hf import HFGenerationBackend
from gymv.backends.training.base import TrainingBackend
from gymv.backends.training.hf_torch import HFTorchBackend


def _mark(model_path: str, kind: str) -> None:
    p = Path(model_path)
    (p.parent / f"{p.name}.{kind}-backend.{os.getpid()}").write_text(kind)


class WrappedGeneration(GenerationBackend):
    def __init__(self, inner: GenerationBackend):
        self.inner = inner
        self.tokenizer, self.adapter, self.chat_template = inner.tokenizer, inner.adapter, inner.chat_template
        self.calls = 0

    @classmethod
    def create(cls, model_path, *, device="cpu", dtype="float32", seed=0):
        _mark(model_path, "generation")
        return cls(HFGenerationBackend.create(model_path, device=device, dtype=dtype, seed=seed))

    def generate(self, requests, params):
        self.calls += 1
        return self.inner.generate(requests, params)

    def update_weights(self, weights):
        self.inner.update_weights(weights)

    def reset_encoder_cache(self):
        self.inner.reset_encoder_cache()

    def weights_hash(self):
        return self.inner.weights_hash()

    def stats(self):
        return {**self.inner.stats(), "wrapped_generate_calls": self.calls}


class WrappedTraining(TrainingBackend):
    def __init__(self, inner: TrainingBackend):
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size
        self.tokenizer, self.adapter, self.chat_template = inner.tokenizer, inner.adapter, inner.chat_template

    @classmethod
    def create(cls, setup, *, device, rank=0, world_size=1):
        _mark(setup.model_path, "training")
        return cls(HFTorchBackend.create(setup, device=device, rank=rank, world_size=world_size))

    @property
    def steps(self):
        return self.inner.steps

    def learning_rate(self, step):
        return self.inner.learning_rate(step)

    def train_step(self, samples, loss_fn):
        return {**self.inner.train_step(samples, loss_fn), "train/wrapped_steps": float(self.inner.steps)}

    def compute_logprobs(self, samples, *, reference=False):
        return self.inner.compute_logprobs(samples, reference=reference)

    def sum_over_ranks(self, value):
        return self.inner.sum_over_ranks(value)

    def named_weights(self):
        return self.inner.named_weights()

    def parameter_count(self):
        return self.inner.parameter_count()

    def save(self, path):
        self.inner.save(path)

    def load(self, path):
        self.inner.load(path)

    def export_hf(self, path):
        self.inner.export_hf(path)
