"""Where a run's workers go, as arithmetic only (no Ray): generation engines that may span several GPUs
(tensor parallel), and a trainer that is a group of ranks laid out as a tensor x pipeline x data mesh.

GPUs are numbered 0..gpus-1 across the run (node-major, as Ray bundles are). Colocated, generation and
training share every GPU; separate, generation takes the first `generation_gpus` and training the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gymv.backends.registry import GENERATION_BACKENDS
from gymv.sections import ClusterSection, RolePlacement


@dataclass(frozen=True)
class TrainerMesh:
    """Ranks of one trainer: rank r sits at (data, pipeline, tensor) with tensor varying fastest."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1

    @property
    def size(self) -> int:
        return self.tensor * self.pipeline * self.data

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(data, pipeline, tensor) index of `rank`."""
        if not 0 <= rank < self.size:
            raise IndexError(f"rank {rank} outside a mesh of {self.size}")
        return rank // (self.tensor * self.pipeline), rank // self.tensor % self.pipeline, rank % self.tensor

    def data_group(self, rank: int) -> list[int]:
        """The ranks that hold the same model shard as `rank` (its gradients are averaged with theirs)."""
        _, p, t = self.coords(rank)
        return [d * self.tensor * self.pipeline + p * self.tensor + t for d in range(self.data)]

    def publishes(self, rank: int) -> bool:
        """Whether `rank` sends weights at a refit: the first data replica's ranks, each with its shard."""
        return self.coords(rank)[0] == 0


@dataclass(frozen=True)
class Pin:
    """Where one role's workers may go (`cluster.placement.<role>`): a placement-group strategy (None: the
    role's default) and the node labels and custom resources each worker (or bundle) asks for."""

    strategy: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    resources: tuple[tuple[str, float], ...] = ()

    @classmethod
    def from_section(cls, s: RolePlacement) -> Pin:
        return cls(s.strategy, tuple(sorted(s.labels.items())), tuple(sorted(s.resources.items())))

    def __bool__(self) -> bool:
        return bool(self.strategy or self.labels or self.resources)


@dataclass(frozen=True)
class Deadlines:
    """Seconds a wait on Ray may take before gymv stops it with an error naming what it waited for: the
    `cluster` section's timeouts, read from the section itself."""

    cluster: ClusterSection = field(default_factory=ClusterSection)

    @property
    def placement_s(self) -> float:
        """Placement groups ready (and nodes joined)."""
        return self.cluster.placement_timeout_s

    @property
    def start_s(self) -> float:
        """Workers built (models loaded)."""
        return self.cluster.start_timeout_s

    @property
    def phase_s(self) -> float:
        """One phase of a step (rollouts, training, ...)."""
        return self.cluster.phase_timeout_s

    @classmethod
    def from_config(cls, c: ClusterSection) -> Deadlines:
        return cls(c)


@dataclass(frozen=True)
class Placement:
    num_generation: int = 1  # generation engines
    num_training: int = 1  # training ranks
    gpus: int = 0  # GPUs of the whole run (0 = CPU)
    colocated: bool = True
    generation_per_gpu: int = 1  # generation engines sharing each generation GPU
    generation_tp: int = 1  # GPUs each generation engine spans (tensor parallel)
    mesh: TrainerMesh | None = None  # the training ranks' layout (None: all data parallel)
    nodes: int = 1  # on a CPU: Ray nodes the training ranks spread over (GPU runs place by their GPUs)
    generation_pin: Pin = Pin()
    training_pin: Pin = Pin()
    deadlines: Deadlines = Deadlines()

    def __post_init__(self):
        if self.generation_tp > 1 and self.generation_per_gpu > 1:
            raise ValueError("an engine that spans several GPUs cannot share them with other engines")
        if self.mesh is not None and self.mesh.size != self.num_training:
            raise ValueError(f"a mesh of {self.mesh.size} ranks for {self.num_training} training ranks")

    @classmethod
    def from_config(cls, cfg, *, num_training: int | None = None) -> Placement:
        c = cfg.cluster
        k = c.generation_workers_per_gpu
        total = c.num_nodes * c.gpus_per_node
        tp = _generation_tp(cfg) if total else 1
        where = dict(generation_pin=Pin.from_section(c.placement.generation),
                     training_pin=Pin.from_section(c.placement.training), deadlines=Deadlines.from_config(c))
        if total == 0:
            ranks = num_training or c.cpu_training_ranks
            return cls(k, ranks, 0, True, k, nodes=c.num_nodes if ranks > 1 else 1, **where)
        if c.colocated:
            gen_gpus, train = total, num_training or total
        else:
            gen_gpus, train = c.generation_gpus or 1, num_training or c.training_gpus or 1
        engines = gen_gpus // tp * k if tp > 1 else gen_gpus * k
        return cls(engines, train, total, c.colocated, k, tp, _mesh(cfg, train), **where)

    @property
    def trainer_mesh(self) -> TrainerMesh:
        return self.mesh or TrainerMesh(data=self.num_training)

    @property
    def generation_gpus(self) -> int:
        if self.gpus == 0:
            return 0
        return self.gpus if self.colocated else self.num_generation * self.generation_tp // self.generation_per_gpu

    def engine_gpus(self, engine: int) -> list[int]:
        """The GPUs generation engine `engine` runs on (its tensor-parallel group)."""
        if self.gpus == 0:
            return []
        if not 0 <= engine < self.num_generation:
            raise IndexError(f"engine {engine} of {self.num_generation}")
        first = engine // self.generation_per_gpu * self.generation_tp
        return list(range(first, first + self.generation_tp))

    def rank_gpu(self, rank: int) -> int | None:
        """The GPU of training rank `rank` (colocated: the same GPUs as generation; else after them)."""
        if self.gpus == 0:
            return None
        if not 0 <= rank < self.num_training:
            raise IndexError(f"rank {rank} of {self.num_training}")
        return rank if self.colocated else self.generation_gpus + rank


def _generation_tp(cfg) -> int:
    g = cfg.generation
    return g.vllm.tensor_parallel_size if GENERATION_BACKENDS.capabilities(g.backend).reads_vllm_section else 1


def _mesh(cfg, ranks: int) -> TrainerMesh | None:
    p = cfg.training.parallel
    mp = p.tensor * p.pipeline
    if mp == 1 or ranks % mp:
        return None
    return TrainerMesh(tensor=p.tensor, pipeline=p.pipeline, data=ranks // mp)
