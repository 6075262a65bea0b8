"""Pydantic schema of a recipe: one model per algorithm, every section closed (`extra="forbid"`).

`algorithm:` selects the model. VLM variants (`vlm_*`) are their text counterparts plus a required
`vision:` section. The sections themselves live in gymv.sections, below the backends and workers that take
them; this module composes the recipe from them, adds the checks that need a registry (backend, transport,
tool-call format, loss and baseline names) as thin subclasses, and re-exports every name. Cross-field rules
(GPU counts, refit capabilities, MOPD routing) live in compat.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from gymv import sections
from gymv.algorithms.registry import BASELINES, KL_ESTIMATORS, LOSS_AGGREGATIONS
from gymv.backends.registry import AUTO_TRANSPORT, REFIT_TRANSPORTS
from gymv.capabilities import backend_names, backend_registry
from gymv.registry import Registry
from gymv.rollout.tool_formats import available
from gymv.sections import (  # noqa: F401  (re-exported: gymv.config.schema names every section)
    MAX_RESTARTS,
    AsyncSection,
    CheckpointSection,
    ClusterSection,
    DataSection,
    EnvSection,
    Fraction,
    FsdpSection,
    ImportanceSampling,
    LoggerSection,
    LogprobErrorGuard,
    ModelSection,
    MoeSection,
    NonNegFloat,
    NonNegInt,
    ParallelSection,
    PlacementSection,
    PosFloat,
    PosInt,
    PrepareSection,
    RayStrategy,
    RefitCheckSection,
    RolePlacement,
    Section,
    SeqErrorThreshold,
    VisionSection,
    VllmSection,
)


def _known_backend(key: str, name: str) -> str:
    known = backend_names(key)
    if name not in known:
        raise _choice_error(backend_registry(key).what, name, known)
    return name


def _choice_error(what: str, name: str, known: list[str]) -> PydanticCustomError:
    """Reported like a bad Literal choice (gymv.config.validate)."""
    return PydanticCustomError("choice", "unknown {what} '{name}'; known: {known}",
                               {"what": what, "name": name, "known": ", ".join(known), "choices": known})


def _registered(registry: Registry):
    """A validator: the value is a name `registry` knows (a built-in, a registered one, an entry point)."""
    def check(name: str) -> str:
        if name not in registry:
            raise _choice_error(registry.what, name, list(registry.available()))
        return name
    return check


class RolloutSection(sections.RolloutSection):
    """The `rollout:` section, its tool-call format a registered one."""

    @field_validator("tool_call_format")
    @classmethod
    def _known_format(cls, v: str) -> str:
        if v not in available():
            raise ValueError(f"unknown tool-call format {v!r}; registered: {', '.join(available())}")
        return v


class GenerationSection(sections.GenerationSection):
    """The `generation:` section, its backend a registered one."""

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        return _known_backend("generation.backend", v)


class TrainingSection(sections.TrainingSection):
    """The `training:` section, its backend a registered one."""

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        return _known_backend("training.backend", v)


class RefitSection(sections.RefitSection):
    """The `refit:` section, its transport a registered one (or auto)."""

    @field_validator("transport")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in REFIT_TRANSPORTS and v != AUTO_TRANSPORT:
            raise ValueError(f"unknown refit transport {v!r}; registered: {', '.join(REFIT_TRANSPORTS.available())} "
                             f"(or {AUTO_TRANSPORT}: chosen from the placement)")
        return v


class TeacherSection(sections.TeacherSection):
    """One of `mopd.teachers`, its backend a registered one."""

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        return _known_backend("mopd.teachers.*.backend", v)


Aggregation = Annotated[str, AfterValidator(_registered(LOSS_AGGREGATIONS))]


class GrpoLoss(Section):
    clip_low: NonNegFloat = 0.2
    clip_high: NonNegFloat = 0.2
    kl_coef: NonNegFloat = 0.01
    kl_estimator: Annotated[str, AfterValidator(_registered(KL_ESTIMATORS))] = "k3"
    aggregation: Aggregation = "token_mean"


class AdvantageClip(Section):
    # bounds on the advantages the loss trains with, after normalisation (NeMo RL's advantage_clip_low/high):
    # null is no bound on that side
    clip_low: float | None = None
    clip_high: float | None = None

    @model_validator(mode="after")
    def _ordered(self) -> "AdvantageClip":
        if self.clip_low is not None and self.clip_high is not None and self.clip_low >= self.clip_high:
            raise ValueError(f"clip_low {self.clip_low:g} must be below clip_high {self.clip_high:g}")
        return self

    def bounds(self) -> tuple[float | None, float | None] | None:
        """(low, high), or None where neither side is bounded."""
        return None if self.clip_low is None and self.clip_high is None else (self.clip_low, self.clip_high)


class Advantage(AdvantageClip):
    baseline: Annotated[str, AfterValidator(_registered(BASELINES))] = "leave_one_out"
    normalize_std: bool = True
    std: Literal["unbiased", "population"] = "unbiased"
    eps: PosFloat = 1e-6


class MopdLossSection(Section):
    # token_mean: the mean over every generated token of the step; seq_mean_token_mean: each sequence's
    # token mean, then the mean over sequences (NeMo RL's token_level_loss: false)
    aggregation: Aggregation = "token_mean"


class GrpoSection(Section):
    prompts_per_step: PosInt = 8
    generations_per_prompt: PosInt = 4
    max_steps: PosInt = 100
    val_period: NonNegInt = 10
    val_at_start: bool = False
    val_prompts: NonNegInt = 32
    loss: GrpoLoss = GrpoLoss()
    advantage: Advantage = Advantage()
    async_: AsyncSection = Field(AsyncSection(), alias="async")
    importance_sampling: ImportanceSampling = ImportanceSampling()
    seq_logprob_error_threshold: SeqErrorThreshold = None
    overlong_filtering: bool = False  # NeMo RL's key: episodes a token budget cut leave the loss
    logprob_error_guard: LogprobErrorGuard = LogprobErrorGuard()


class SftSection(Section):
    max_steps: PosInt = 100
    batch_size: PosInt = 8
    val_period: NonNegInt = 10
    val_at_start: bool = False
    val_prompts: NonNegInt = 32
    aggregation: Aggregation = "token_mean"


class MopdSection(Section):
    prompts_per_step: PosInt = 8
    generations_per_prompt: PosInt = 1
    max_steps: PosInt = 100
    val_period: NonNegInt = 10
    val_at_start: bool = False
    val_prompts: NonNegInt = 32
    teachers: Annotated[dict[str, TeacherSection], Field(min_length=1)]
    agent_to_teacher: dict[str, str] = {}
    strict_agent_name_match: bool = True
    default_teacher_alias: str | None = None
    env_reward_coef: NonNegFloat = 0.0
    # 0: per-token advantage log pi_teacher - log pi_student on the sampled token; k > 0: distil the
    # teacher's k most likely tokens at every position of the student's samples (cross-entropy to them)
    top_k: NonNegInt = 0
    loss: MopdLossSection = MopdLossSection()
    advantage: AdvantageClip = AdvantageClip()  # bounds on the per-token teacher advantage
    async_: AsyncSection = Field(AsyncSection(), alias="async")
    importance_sampling: ImportanceSampling = ImportanceSampling()
    seq_logprob_error_threshold: SeqErrorThreshold = None
    overlong_filtering: bool = False  # NeMo RL's key: episodes a token budget cut leave the loss
    logprob_error_guard: LogprobErrorGuard = LogprobErrorGuard()

    @model_validator(mode="after")
    def _clip_has_an_advantage_to_bound(self) -> "MopdSection":
        if self.advantage.bounds() is None:
            return self
        if self.top_k > 0:
            raise ValueError("advantage.clip_low/clip_high bound the sampled token's teacher advantage, which top_k "
                             "distillation (a cross-entropy to the teacher's candidates) does not use; set top_k: 0 "
                             "or drop the bounds")
        if self.env_reward_coef > 0:
            raise ValueError("advantage.clip_low/clip_high bound the teacher advantage alone, and env_reward_coef "
                             "adds the reward advantage unbounded beside it; set env_reward_coef: 0 or drop the bounds")
        return self


class RecipeBase(Section):
    algorithm: str
    name: str | None = None
    seed: int = 42
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    env: EnvSection = EnvSection()
    rollout: RolloutSection = RolloutSection()
    generation: GenerationSection = GenerationSection()
    training: TrainingSection = TrainingSection()
    refit: RefitSection = RefitSection()
    cluster: ClusterSection = ClusterSection()
    checkpoint: CheckpointSection = CheckpointSection()
    logger: LoggerSection = LoggerSection()
    checks: list[str] = []
    smoke: dict[str, Any] = {}

    @model_validator(mode="after")
    def _fill_global_batch(self) -> "RecipeBase":
        if self.training.global_batch_size is None and hasattr(self, base_algorithm(self.algorithm)):
            self.training.global_batch_size = self.samples_per_step
        return self

    @property
    def samples_per_step(self) -> int:
        """Samples one step trains on: sft.batch_size, or prompts_per_step x generations_per_prompt."""
        s = self.algo_section
        if isinstance(s, SftSection):
            return s.batch_size
        return s.prompts_per_step * s.generations_per_prompt  # type: ignore[attr-defined]

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps of the whole run: max_steps x (samples of a step / global_batch_size)."""
        per_step = max(1, self.samples_per_step // (self.training.global_batch_size or self.samples_per_step))
        return self.algo_section.max_steps * per_step  # type: ignore[attr-defined]

    @property
    def base_algorithm(self) -> str:
        return base_algorithm(self.algorithm)

    @property
    def is_vlm(self) -> bool:
        return is_vlm(self.algorithm)

    @property
    def algo_section(self) -> BaseModel:
        return getattr(self, self.base_algorithm)

    def to_dict(self) -> dict:
        """Plain data with the keys as written in recipes (`async`, not `async_`)."""
        return self.model_dump(mode="json", by_alias=True)


class SftRecipe(RecipeBase):
    algorithm: Literal["sft"]
    sft: SftSection = SftSection()


class GrpoRecipe(RecipeBase):
    algorithm: Literal["grpo"]
    grpo: GrpoSection = GrpoSection()


class MopdRecipe(RecipeBase):
    algorithm: Literal["mopd"]
    mopd: MopdSection


class VlmSftRecipe(SftRecipe):
    algorithm: Literal["vlm_sft"]
    vision: VisionSection


class VlmGrpoRecipe(GrpoRecipe):
    algorithm: Literal["vlm_grpo"]
    vision: VisionSection


class VlmMopdRecipe(MopdRecipe):
    algorithm: Literal["vlm_mopd"]
    vision: VisionSection


RecipeConfig = SftRecipe | GrpoRecipe | MopdRecipe | VlmSftRecipe | VlmGrpoRecipe | VlmMopdRecipe

MODELS: dict[str, type[RecipeBase]] = {
    "sft": SftRecipe, "grpo": GrpoRecipe, "mopd": MopdRecipe,
    "vlm_sft": VlmSftRecipe, "vlm_grpo": VlmGrpoRecipe, "vlm_mopd": VlmMopdRecipe,
}
ALGORITHMS: tuple[str, ...] = tuple(MODELS)
ALGORITHM_SECTIONS: tuple[str, ...] = ("sft", "grpo", "mopd")


def is_vlm(algorithm: str) -> bool:
    return algorithm.startswith("vlm_")


def base_algorithm(algorithm: str) -> str:
    """`vlm_grpo` -> `grpo`: the section name and the algorithm family."""
    return algorithm[4:] if is_vlm(algorithm) else algorithm
