"""A generation backend whose refits go wrong the ways real loaders have: it is gymv's hf backend, except that
`update_weights` reads a fault from the file `<model folder>.refit-fault` (written by a test; absent or empty:
no fault) and, when there is one, loads
- `nothing`: no tensor at all, and reports success;
- `half`: every other tensor only;
- `layout`: every tensor, each matrix with its rows in reverse order (a wrong layout of the right shape).
`StartsElsewhere` is one that started from other weights than the checkpoint's. Each declares the refit check its parent declares, so the run checks it; Ray workers import it by path."""

from __future__ import annotations

from pathlib import Path

from gymv.backends.generation.base import named
from gymv.backends.generation.hf import HFGenerationBackend
from gymv.backends.generation.vllm import VllmGenerationBackend
from gymv.backends.registry import GENERATION_BACKENDS, BackendCapabilities

FAULTS = ("nothing", "half", "layout")


def fault_file(model_path: str | Path) -> Path:
    p = Path(model_path)
    return p.parent / f"{p.name}.refit-fault"


def set_fault(model_path: str | Path, fault: str) -> None:
    """From the next refit on, engines of the model at `model_path` load with `fault` ("": none)."""
    fault_file(model_path).write_text(fault)


def _faulty(update_weights):
    """`update_weights` of a backend class, with the fault of `self.fault_path` applied to what it loads."""

    def update(self, weights):
        fault = self.fault_path.read_text().strip() if self.fault_path.exists() else ""
        incoming = named(weights)
        if fault == "nothing":
            return
        if fault == "half":
            incoming = {k: v for i, (k, v) in enumerate(sorted(incoming.items())) if i % 2 == 0}
        elif fault == "layout":
            incoming = {k: v.flip(0) if v.dim() == 2 else v for k, v in incoming.items()}
        update_weights(self, incoming)

    return update


class FaultyRefits(HFGenerationBackend):
    capabilities = BackendCapabilities(refit_check="digest")

    @classmethod
    def create(cls, model_path, *, device="cpu", dtype="float32", seed=0, trust_remote_code=False):
        backend = super().create(model_path, device=device, dtype=dtype, seed=seed)
        backend.fault_path = fault_file(model_path)
        return backend

    update_weights = _faulty(HFGenerationBackend.update_weights)


class StartsElsewhere(FaultyRefits):
    """Loads the checkpoint and then moves its LM head: an engine that started from other weights."""

    @classmethod
    def create(cls, model_path, **kwargs):
        import torch

        backend = super().create(model_path, **kwargs)
        with torch.no_grad():
            backend.model.get_output_embeddings().weight.mul_(0.5)
        return backend


class FaultyRefitsProbed(FaultyRefits):
    """The same faults, checked by the probe instead of the digests."""

    capabilities = BackendCapabilities(refit_check="probe")


class VllmFaultyRefits(VllmGenerationBackend):
    """The same faults on the vllm backend (importable without vLLM: the engine is built only in `create`);
    its refits are checked by the probe, as the vllm backend's are."""

    capabilities = GENERATION_BACKENDS.capabilities("vllm")

    @classmethod
    def create(cls, model_path, **kwargs):
        backend = super().create(model_path, **kwargs)
        backend.fault_path = fault_file(model_path)
        return backend

    update_weights = _faulty(VllmGenerationBackend.update_weights)
