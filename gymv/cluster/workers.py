"""The Ray actors of a run: generation workers (HF backend + environments + the agent loop) and training
workers (TorchTrainer, data parallel over torch.distributed when there are several).

The classes are plain Python; `gymv.cluster.group` wraps them with `ray.remote` and places them, and tests
may also build them in-process. Every method is one phase of a step, so the driver makes one Ray round
trip per phase. On CPU each actor takes all of the machine's threads: the phases of a synchronous step
alternate, so generation and training never compete for them.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gymv.errors import GymvError
from gymv.train.data import EnvRouter, EnvSpec

HF_FILE_PREFIXES = ("config.json", "generation_config.json", "tokenizer", "special_tokens_map", "vocab", "merges",
                    "added_tokens", "chat_template", "processor_config", "preprocessor_config", "video_preprocessor")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build itself; plain data, pickled into each actor."""

    model_path: str
    env: EnvSpec
    seed: int = 0
    device: str = "cpu"
    generation_dtype: str = "float32"
    temperature: float = 1.0
    threads: int | None = None
    refit_transport: str = "object_store"
    reset_encoder_cache: bool = False
    trainer: dict = field(default_factory=dict)  # TrainerConfig fields
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    total_steps: int = 0  # optimizer steps of the whole run (the schedule's end)
    gradient_checkpointing: bool = False
    kl_reference: bool = False
    max_seq_len: int = 2048
    max_image_pixels: int | None = None
    trust_remote_code: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)  # into every chat-template rendering
    tool_call_format: str = "hermes"


def _set_threads(threads: int | None) -> None:
    import torch

    n = threads or _cpu_count()
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)


def _cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _device(spec: WorkerSpec):
    import torch

    if spec.device == "cuda":
        if not torch.cuda.is_available():
            raise GymvError("the recipe asks for GPUs but this worker sees none", where="cluster.gpus_per_node",
                            fix="set cluster.gpus_per_node: 0 to run on CPU")
        torch.cuda.set_device(0)  # Ray gives each actor its own CUDA_VISIBLE_DEVICES
        return torch.device("cuda", 0)
    return torch.device("cpu")


def copy_hf_files(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Copy a checkpoint folder's config, tokenizer, processor and chat-template files (and remote code), so
    that a folder of trained weights loads with `from_pretrained` and as `model.path` of another run."""
    source, target = Path(source), Path(target)
    for f in source.iterdir():
        wanted = f.name.startswith(HF_FILE_PREFIXES) or f.suffix == ".py"
        if f.is_file() and wanted and not (target / f.name).exists():
            shutil.copy2(f, target / f.name)


# -------------------------------------------------------------------------------------------- generation


class GenerationWorker:
    """Hosts the HF generation backend, the environments and the agent loop; receives refits."""

    def __init__(self, spec: WorkerSpec, index: int = 0):
        import torch

        from gymv.backends.generation.hf import HFGenerationBackend
        from gymv.models.load import load_policy

        _set_threads(spec.threads)
        self.spec, self.index = spec, index
        self.device = _device(spec)
        self.dtype = getattr(torch, spec.generation_dtype)
        self.policy = load_policy(spec.model_path, device=str(self.device), dtype=self.dtype, seed=spec.seed,
                                  trust_remote_code=spec.trust_remote_code)
        self.backend = HFGenerationBackend.from_policy(self.policy, seed=spec.seed + 7919 * index)
        self.router = EnvRouter(spec.env)
        self.receiver = None
        self.weights_version = 0
        self.episodes = 0  # episodes this worker has run
        # Held while generating and while loading weights: an in-flight refit (its own Ray concurrency
        # group) lands between two generate calls, never inside one.
        self._weights_lock = threading.Lock()

    # -- rollouts ------------------------------------------------------------------------------------
    def rollouts(self, rows: Sequence[tuple[int, dict]], *, group_size: int, params, seed: int | None,
                 **limits) -> dict:
        """Run the agent loop on `rows` (G episodes each); `limits` are run_rollouts' budget keywords."""
        from gymv.rollout import run_rollouts

        t0, started = time.perf_counter(), time.time()
        p = self.policy
        stats: dict = {}
        version = self.weights_version
        cache_before = self.backend.stats()
        trajectories = run_rollouts(_Locked(self.backend, self._weights_lock), p.adapter, p.tokenizer, p.chat_template,
                                    self.router, list(rows), group_size=group_size, params=params, seed=seed,
                                    weights_version=version, stats=stats, **limits)
        cache_after = self.backend.stats()
        self.episodes += len(trajectories)
        stats["encoder_cache_stale_hits"] = cache_after["encoder_cache_stale_hits"] - cache_before["encoder_cache_stale_hits"]
        return {"trajectories": trajectories, "seconds": time.perf_counter() - t0, "stats": stats,
                "weights_version": version, "last_weights_version": self.weights_version,
                "started_at": started, "ended_at": time.time()}

    def pid(self) -> int:
        return os.getpid()

    # -- refit ---------------------------------------------------------------------------------------
    def refit_connect(self, info: dict | None, rank: int) -> None:
        from gymv.cluster.refit import make_receiver

        self.receiver = make_receiver(self.spec.refit_transport, self.device, info, rank)
        self.receiver.connect()

    def receive(self, payload, version: int) -> dict:
        """Load the published weights; reset the encoder cache only after they loaded (when configured)."""
        t0 = time.perf_counter()
        if self.receiver is None:
            self.refit_connect(None, 1 + self.index)
        weights = self.receiver.receive(payload)
        self._load(weights, version)
        return {"seconds": time.perf_counter() - t0}

    def restore(self, weights: dict, version: int) -> None:
        """Load a CPU copy of the trainer's weights (a replacement worker catching up, outside the transport)."""
        self._load(weights, version)

    def _load(self, weights, version: int) -> None:
        """Load the weights; reset the encoder cache only after they loaded (when configured)."""
        self._check_weights(weights)  # all or nothing: never leave the generator with half a refit
        with self._weights_lock:
            self.backend.update_weights(weights)
            del weights
            if self.device.type == "cuda":
                import torch

                torch.cuda.synchronize(self.device)
            self.weights_version = version
            if self.spec.reset_encoder_cache:
                self.backend.reset_encoder_cache()

    def _check_weights(self, weights) -> None:
        own = self.backend.model.state_dict()
        for name, value in weights.items():
            if name not in own or tuple(value.shape) != tuple(own[name].shape):
                got = "unknown name" if name not in own else f"shape {tuple(value.shape)} != {tuple(own[name].shape)}"
                raise GymvError(f"refit sent weights this model cannot take: {name} ({got})", where="refit",
                                fix="training and generation must load the same architecture (model.path)")

    def weights_hash(self) -> str:
        from gymv.cluster.refit import weights_hash

        return weights_hash(self.backend.model.state_dict())

    def stats(self) -> dict:
        return {**self.backend.stats(), "weights_version": self.weights_version, "episodes": self.episodes}

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()


class _Locked:
    """The backend, with each generate call holding the weights lock."""

    def __init__(self, backend, lock):
        self.backend, self.lock = backend, lock

    def generate(self, requests, params):
        with self.lock:
            return self.backend.generate(requests, params)

    def __getattr__(self, name):
        return getattr(self.backend, name)


# ---------------------------------------------------------------------------------------------- training


def _samples_collate(adapter, pad_id: int):
    from gymv.backends.training.micro_batches import pad_collate

    def collate(samples):
        tensors = [{k: v for k, v in s.items() if k not in ("images", "where")} for s in samples]
        mb = pad_collate(tensors, pad_values={"input_ids": pad_id})
        mb["images"] = [list(s.get("images") or ()) for s in samples]
        mb["where"] = [s.get("where") for s in samples]
        return mb

    return collate


def _logprob_fn(adapter, temperature: float):
    from gymv.backends.logprobs import MultimodalBatch, sequence_logprobs

    def logprob_fn(model, mb):
        """Scores the loss-masked tokens only (every loss reads logprobs there alone); other entries are 0.
        With a teacher's top-k candidates in the batch, their student logprobs go into it as
        `logp_student_topk` [B, T, k] for the loss to read."""
        batch = MultimodalBatch(mb["input_ids"], mb["attention_mask"], mb["images"], mb["where"])
        candidates = mb.get("teacher_topk_ids")
        out = sequence_logprobs(model, adapter, batch, temperature, return_entropy=True,
                                score_mask=mb.get("loss_mask"), gather_ids=candidates)
        if candidates is None:
            return out
        logp, entropy, mb["logp_student_topk"] = out
        return logp, entropy

    return logprob_fn


def _plan_fn(adapter, model):
    """Micro-batches that keep a group's samples together: their shared prompt then runs once per group."""
    from gymv.backends.logprobs import prefix_key, recomputes_activations
    from gymv.backends.training.micro_batches import plan_micro_batches, plan_shared_prefix_micro_batches

    def plan(samples, max_tokens):
        lengths = [int(s["input_ids"].shape[0]) for s in samples]
        if recomputes_activations(model):
            return plan_micro_batches(lengths, max_tokens)
        hashes: dict = {}
        keys = [prefix_key(s["input_ids"], s["loss_mask"], s.get("images") or (), adapter.image_token_id, hashes)
                for s in samples]
        return plan_shared_prefix_micro_batches(keys, lengths, max_tokens)

    return plan


_SAMPLE_DTYPES = {"input_ids": "long", "loss_mask": "bool", "teacher_topk_ids": "long"}  # any other numeric field: float32


def _as_tensors(sample: dict) -> dict:
    """A sample whose numeric fields may arrive as lists or numpy arrays, with tensors in their place (in
    place). Plain lists cross Ray far faster than 64 samples x 4 small tensors, each pickled on its own."""
    import torch

    for k, v in sample.items():
        if k not in ("images", "where") and not isinstance(v, torch.Tensor):
            sample[k] = torch.as_tensor(v, dtype=getattr(torch, _SAMPLE_DTYPES.get(k, "float32")))
    return sample


def _merge_minibatch_metrics(rows: list[dict]) -> dict:
    """Metrics of several optimizer steps in one algorithm step: counts add up, extremes reduce, rest average."""
    if len(rows) == 1:
        return rows[0]
    out: dict[str, float] = {}
    for k in rows[0]:
        vals = [r[k] for r in rows if k in r]
        if k.startswith("train/num_") or k.startswith("timing/"):
            out[k] = sum(vals)
        elif k.endswith("_max"):
            out[k] = max(vals)
        elif k.endswith("_min"):
            out[k] = min(vals)
        else:
            out[k] = sum(vals) / len(vals)
    return out


class TrainingWorker:
    """One data-parallel rank: the policy under training, an optional frozen reference, refit sending."""

    def __init__(self, spec: WorkerSpec, rank: int = 0, world_size: int = 1):
        _set_threads(spec.threads)
        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.device = _device(spec)
        self.trainer = None
        self.sender = None

    def address(self) -> tuple[str, int]:
        """(host, free port) for the data-parallel rendezvous (asked of rank 0)."""
        import socket

        import ray.util

        try:
            host = ray.util.get_node_ip_address()
        except Exception:
            host = "127.0.0.1"
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def setup(self, master: tuple[str, int] | None = None) -> dict:
        """Join the data-parallel group (if any), load the policy and build the trainer."""
        import torch

        from gymv.backends.training.torch_trainer import TorchTrainer, TrainerConfig
        from gymv.models.load import load_policy

        group = None
        if self.world_size > 1:
            import torch.distributed as dist

            backend = "nccl" if self.device.type == "cuda" else "gloo"
            host, port = master
            dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                    world_size=self.world_size)
        self.policy = load_policy(self.spec.model_path, device=str(self.device), dtype=torch.float32, seed=self.spec.seed,
                                  trust_remote_code=self.spec.trust_remote_code)
        model = self.policy.model
        if self.spec.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        pad = self.policy.tokenizer.pad_token_id or 0
        self.collate = _samples_collate(self.policy.adapter, pad)
        self.logprob_fn = _logprob_fn(self.policy.adapter, self.spec.temperature)
        config = TrainerConfig(**self.spec.trainer)
        self.trainer = TorchTrainer(model, self.logprob_fn, config, collate_fn=self.collate, device=self.device,
                                    process_group=group, plan_fn=_plan_fn(self.policy.adapter, model))
        self.reference = None
        if self.spec.kl_reference:
            ref = load_policy(self.spec.model_path, device=str(self.device), dtype=torch.float32, seed=self.spec.seed,
                              trust_remote_code=self.spec.trust_remote_code).model
            ref.requires_grad_(True)
            self.reference = TorchTrainer(ref, self.logprob_fn, config, collate_fn=self.collate, device=self.device,
                                          process_group=group, plan_fn=_plan_fn(self.policy.adapter, ref))
        self.router = EnvRouter(self.spec.env)
        return {"parameters": sum(p.numel() for p in model.parameters())}

    # -- steps ---------------------------------------------------------------------------------------
    def _set_lr(self) -> None:
        from gymv.backends.training.lr_schedule import lr_factor

        s = self.spec
        if s.warmup_steps <= 0 and s.lr_schedule == "constant":
            return
        lr = self.trainer.config.lr * lr_factor(self.trainer.steps + 1, warmup_steps=s.warmup_steps,
                                                total_steps=s.total_steps, schedule=s.lr_schedule,
                                                min_ratio=s.min_lr_ratio)
        for g in self.trainer.optimizer.param_groups:
            g["lr"] = lr

    def _train_minibatches(self, minibatches: list[list[dict]], loss_fn) -> dict:
        rows = []
        for samples in minibatches:
            self._set_lr()
            rows.append(self.trainer.train_step(samples, loss_fn))
        return _merge_minibatch_metrics(rows)

    def grpo_step(self, minibatches: list[list[dict]], loss_fn) -> dict:
        """Reference and old logprobs where needed, then one optimizer step per minibatch."""
        t0 = time.perf_counter()
        flat = [_as_tensors(s) for mb in minibatches for s in mb]
        if self.reference is not None and flat:
            for s, lp in zip(flat, self.reference.compute_logprobs(flat)):
                s["logp_ref"] = lp
        if len(minibatches) > 1 and flat:  # later minibatches see moved weights: ratios need the old policy
            for s, lp in zip(flat, self.trainer.compute_logprobs(flat)):
                s["logp_old"] = lp
        t1 = time.perf_counter()
        metrics = self._train_minibatches(minibatches, loss_fn)
        metrics["timing/logprobs_s"] = t1 - t0
        metrics["timing/training_s"] = time.perf_counter() - t1
        return metrics

    def sft_samples(self, rows: Sequence[tuple[int, dict, str]]) -> list[dict]:
        """Training samples of the rows' gold answers (tokens exactly as the agent loop would lay them out)."""
        import torch

        from gymv.rollout import ImageCache, build_sft_sample

        p = self.policy
        cache = ImageCache(max_pixels=self.spec.max_image_pixels)
        out = []
        for task_index, row, where in rows:
            traj = build_sft_sample(self.router(row, where), row, p.adapter, p.tokenizer, p.chat_template,
                                    max_seq_len=self.spec.max_seq_len, task_index=task_index,
                                    max_image_pixels=self.spec.max_image_pixels, image_cache=cache,
                                    chat_template_kwargs=self.spec.chat_template_kwargs or None,
                                    tool_call_format=self.spec.tool_call_format)
            if getattr(traj, "error", None):
                raise GymvError(f"cannot build an SFT sample: {traj.error}", where=where)
            out.append({"input_ids": torch.tensor(traj.token_ids, dtype=torch.long),
                        "loss_mask": torch.tensor(traj.loss_mask, dtype=torch.bool),
                        "images": list(traj.images or ()), "where": where})
        return out

    def sft_step(self, rows: Sequence[tuple[int, dict, str]], loss_fn) -> dict:
        import torch

        t0 = time.perf_counter()
        samples = self.sft_samples(rows)
        t1 = time.perf_counter()
        metrics = self._train_minibatches([samples], loss_fn)
        metrics["train/num_input_tokens"] = float(self.trainer.dp.sum_(
            torch.tensor([float(sum(len(s["input_ids"]) for s in samples))], device=self.device)))
        metrics["timing/samples_s"] = t1 - t0
        metrics["timing/training_s"] = time.perf_counter() - t1
        return metrics

    # -- refit ---------------------------------------------------------------------------------------
    def refit_open(self, num_receivers: int) -> dict | None:
        import torch

        from gymv.cluster.refit import make_sender

        self.sender = make_sender(self.spec.refit_transport, getattr(torch, self.spec.generation_dtype),
                                  self.device, num_receivers)
        return {"info": self.sender.rendezvous(self.trainer.state_dict()), "in_band": self.sender.in_band}

    def refit_connect(self) -> None:
        self.sender.connect()

    def weights(self) -> dict:
        """A CPU copy of the weights (tests, debugging); refits go through `publish`."""
        return {k: v.detach().cpu().clone() for k, v in self.trainer.state_dict().items()}

    def publish(self):
        return self.sender.publish(self.trainer.state_dict())

    def weights_hash(self) -> str:
        import torch

        from gymv.cluster.refit import weights_hash

        return weights_hash(self.trainer.state_dict(), getattr(torch, self.spec.generation_dtype))

    # -- checkpoints ---------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Rank 0 writes weights, optimizer and the HF files (the folder then loads as a model); every rank
        writes its RNG state."""
        import torch

        from gymv.runs.checkpoint import capture_rng_state

        path_ = Path(path)
        if self.rank == 0:
            self.trainer.save(path_)
            copy_hf_files(self.spec.model_path, path_)
        torch.save(capture_rng_state(), path_ / f"rng_rank{self.rank}.pt")

    def load(self, path: str) -> int:
        import torch

        from gymv.runs.checkpoint import restore_rng_state

        self.trainer.load(path)
        rng = Path(path) / f"rng_rank{self.rank}.pt"
        if rng.exists():
            restore_rng_state(torch.load(rng, weights_only=True))
        return self.trainer.steps

    def export(self, path: str) -> str:
        """Write a standalone Hugging Face checkpoint (save_pretrained) atomically: tmp folder, then rename."""
        from gymv.models.quiet import quiet_transformers

        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with quiet_transformers():
            self.trainer.model.save_pretrained(tmp)
        copy_hf_files(self.spec.model_path, tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
        return str(target)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
