"""Refit checks: after a refit, each generation engine proves it holds the weights the trainer sent.

A transport that reports success says only that bytes moved. What an engine then decodes with can still be
other weights: a loader that skips a layer, writes half a tensor, puts a tensor in the wrong layout, or
leaves an alias of a repacked weight pointing at the old values (vLLM's Mamba `conv_weights` on CPUs that
prepack bfloat16 convolutions: gymv.backends.generation.vllm_worker). So the engine itself is asked, in one
of two ways, each backend declaring which it answers (`BackendCapabilities.refit_check`):

- `digest`: the engine fingerprints every weight as it now holds it, in checkpoint names and layout
  (gymv.backends.weights.tensor_digest), and the fingerprints must equal those of the tensors the trainer
  sent (cast to the generation dtype). Exact: one changed element in one tensor is named.
- `probe`: where an engine's layout cannot be mapped back to checkpoint names (vLLM fuses, shards and
  repacks its parameters), both sides score one fixed sequence (text, and an image for a vision-language
  model) and the engine's logprobs must be the trainer's within the dtype's tolerance.

The trainer's side is computed while it publishes the refit (the digests of the streamed tensors, the
probe's forward pass); the engine's in a task queued right behind the refit on the generation worker
(`GenerationWorker.verify_weights`), which compares the two, so a mismatch fails that refit's phase,
synchronous or asynchronous, with one line naming the tensors (or the probe's gap) and the transport. `refit.check` says how often: every refit up to `first`, then every `every`-th (the engines'
initial weights are checked too, before the first step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gymv.errors import GymvError
from gymv.sections import RefitCheckSection

CHECK_MODES = ("auto", "digest", "probe", "off")
# mean |engine - trainer| over the probe's scored tokens (raw log-softmax) allowed by default, per dtype of
# the engine: a float32 engine agrees with the trainer to float error, a 16-bit one to its rounding
PROBE_TOLERANCE = {"float32": 2e-3, "float16": 2e-2, "bfloat16": 5e-2}
PROBE_TEXT_BEFORE = 8  # text tokens before the probe's image


@dataclass(frozen=True)
class CheckPlan:
    """When and how refits are checked: the recipe's `refit.check` section itself, with the backend's declared
    kind and the tolerance resolved."""

    kind: str | None  # "digest", "probe", or None: not checked
    section: RefitCheckSection = field(default_factory=RefitCheckSection)  # refit.check
    tolerance: float = PROBE_TOLERANCE["float32"]

    @property
    def probe_tokens(self) -> int:
        return self.section.probe_tokens

    def due(self, refit: int) -> bool:
        """Whether refit number `refit` (0: the engines' initial weights; 1: after the first step) is checked."""
        if self.kind is None:
            return False
        first, every = self.section.first, self.section.every
        return refit <= first or (every > 0 and refit % every == 0)


def plan_checks(section: RefitCheckSection, declared: str | None, dtype: str) -> CheckPlan:
    """The plan of a run: `section` is `refit.check`, `declared` the generation backend's own kind (None: it
    declares none), `dtype` the generation dtype."""
    mode = section.mode
    kind = declared if mode == "auto" else (None if mode == "off" else mode)
    tolerance = section.probe_tolerance if section.probe_tolerance is not None else PROBE_TOLERANCE.get(dtype, 5e-2)
    return CheckPlan(kind, section, tolerance)


# ------------------------------------------------------------------------------------------------- probe


@dataclass(frozen=True)
class Probe:
    """A fixed sequence both sides score: `ids` (an image's placeholder span expanded where there is one),
    its `images`, and `scored` (the positions compared: text tokens, never the first nor the image span)."""

    ids: tuple[int, ...]
    images: tuple = ()
    scored: tuple[int, ...] = field(default=())


def probe_image(size: int = 64):
    """A fixed picture with structure at every scale (gradients, stripes, a disc), the same in every process."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size))
    px = img.load()
    for y in range(size):
        for x in range(size):
            px[x, y] = ((x * 255) // size, (y * 255) // size, 255 * ((x // 4 + y // 4) % 2))
    ImageDraw.Draw(img).ellipse((size // 4, size // 4, 3 * size // 4, 3 * size // 4), fill=(200, 40, 90))
    return img


PROBE_TEXT = ("The picture shows three red circles and two blue squares on a white table. Count the red "
              "circles, then answer with one number in a box. A robot walks to the key, picks it up, opens the "
              "door and reaches the green goal square. Which polygon has five sides?")


def build_probe(tokenizer, adapter, tokens: int) -> Probe:
    """`tokens` tokens of a fixed English text (natural text: a model's logprobs of it are neither near 0 nor
    far in the tail, where 16-bit rounding moves logprobs most), special and vision tokens left out, around
    one fixed image for a vision-language model; the same for the same tokenizer."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= set(getattr(adapter, "vision_token_ids", ()) or ())
    words = [t for t in tokenizer.encode(PROBE_TEXT, add_special_tokens=False) if t not in special]
    if not words:
        raise GymvError("the tokenizer encodes the refit probe's text to nothing but special tokens",
                        where="refit.check", fix="set refit.check.mode: digest or off")
    text = (words * (tokens // len(words) + 1))[:tokens]
    if getattr(adapter, "style", "text") == "text":
        return Probe(tuple(text), (), tuple(range(1, len(text))))
    image = probe_image()
    span = list(adapter.image_token_ids(image))
    head, tail = text[:PROBE_TEXT_BEFORE], text[PROBE_TEXT_BEFORE:]
    ids = head + span + tail
    scored = list(range(1, len(head))) + list(range(len(head) + len(span), len(ids)))
    return Probe(tuple(ids), (image,), tuple(scored))


@dataclass(frozen=True)
class CheckRequest:
    """One refit's check, as the driver hands it to both sides: which kind, which refit (0: the engines'
    initial weights), over which transport, the probe (kind `probe`) and its tolerance."""

    kind: str
    refit: int
    transport: str = ""
    probe: Probe | None = None
    tolerance: float = PROBE_TOLERANCE["float32"]
    version: int = 0  # the step whose weights the refit carries (for messages)

    @property
    def what(self) -> str:
        return "the engines' initial weights" if self.refit == 0 else f"step {self.version}'s refit over {self.transport}"


def trainer_probe(backend, probe: Probe) -> list[float]:
    """The trainer's raw logprobs of the probe's scored tokens (a collective on a sharded trainer)."""
    from gymv.backends.training.samples import training_sample

    scored = set(probe.scored)
    sample = training_sample(probe.ids, [i in scored for i in range(len(probe.ids))], images=probe.images,
                             where="refit probe")
    logp = backend.probe_logprobs(sample)
    return [float(logp[i]) for i in probe.scored]


def engine_account(backend, request: CheckRequest, sent: dict[str, str], dtype: str) -> dict:
    """The engine's side: the digests of the tensors the trainer `sent` as it holds them (in `dtype`, the one
    they were sent in, by the trainer's method), or its logprobs of the probe."""
    from gymv.backends.weights import digest_method  # torch: the engine's process only, never the driver's

    names = sent.keys()
    if request.kind == "digest":
        names = list(names)
        method = digest_method(sent[names[0]]) if sent and names else None
        return {"digests": backend.held_digests(names, dtype, method)}
    logp = backend.probe_logprobs(request.probe.ids, request.probe.images)
    return {"probe": [float(logp[i - 1]) for i in request.probe.scored]}


# -------------------------------------------------------------------------------------------- comparison


def _names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def digest_mismatch(sent: dict[str, str], held: dict[str, str]) -> str | None:
    """What differs between the trainer's digests and the engine's, or None when they agree."""
    missing = sorted(n for n in sent if n not in held)
    differ = sorted(n for n in sent if n in held and held[n] != sent[n])
    if not missing and not differ:
        return None
    parts = []
    if differ:
        shapes = [n for n in differ if held[n].split(":")[:2] != sent[n].split(":")[:2]]
        layout = f" ({len(shapes)} in another shape or dtype: {_names(shapes, 2)})" if shapes else ""
        parts.append(f"{len(differ)} of {len(sent)} tensors differ from what the trainer sent: {_names(differ)}{layout}")
    if missing:
        parts.append(f"{len(missing)} sent tensors are not held at all: {_names(missing)}")
    return "; ".join(parts)


def probe_gap(trainer: list[float], engine: list[float]) -> tuple[float, float]:
    """(mean, max) |engine - trainer| over the scored tokens."""
    if len(trainer) != len(engine) or not trainer:
        return float("inf"), float("inf")
    gaps = [abs(a - b) for a, b in zip(trainer, engine)]
    if any(g != g for g in gaps):  # NaN logits on either side
        return float("inf"), float("inf")
    return sum(gaps) / len(gaps), max(gaps)


MOVED = 1e-6  # mean change of the trainer's probe logprobs beyond its own run-to-run noise


def check_refit(check: CheckRequest, trainer: dict, engine: dict, *, worker: str,
                previous: tuple[int, dict, dict] | None = None) -> None:
    """Raise the refit's one-line error when `engine`'s account of its weights is not `trainer`'s.

    `previous` is (step, trainer's, engine's account) of this engine's last probe check: an engine whose
    probe logprobs did not change by one bit while the trainer's moved did not load the refit, however small
    the step (a 16-bit engine's tolerance could hide one step's change; the bits cannot)."""
    what, tolerance = check.what, check.tolerance
    if check.kind == "digest":
        problem = digest_mismatch(trainer["digests"], engine["digests"])
        if problem is None:
            return
        raise GymvError(f"{what}: {worker} does not hold the trainer's weights: {problem}", where="refit.check",
                        exit_code=1, fix="the generation backend loaded other weights than it was sent (a loader "
                                         "that skips or misplaces tensors); see docs/training.md, Refit checks")
    mean, worst = probe_gap(trainer["probe"], engine["probe"])
    if mean <= tolerance and previous is not None and engine["probe"] == previous[2]["probe"]:
        moved, _ = probe_gap(trainer["probe"], previous[1]["probe"])
        if moved > MOVED:
            raise GymvError(f"{what}: {worker} scores the probe sequence exactly as after step {previous[0]} while "
                            f"the trainer's logprobs of it moved {moved:.3g} nats per token: the engine did not load "
                            "the new weights", where="refit.check", exit_code=1,
                            fix="the generation backend's update_weights loaded nothing; see docs/training.md, "
                                "Refit checks")
    if mean <= tolerance:
        return
    raise GymvError(f"{what}: {worker} scores the probe sequence {mean:.3g} nats per token away from the trainer "
                    f"(largest {worst:.3g}; tolerance {tolerance:g}): it does not decode with the trainer's weights",
                    where="refit.check", exit_code=1,
                    fix="the generation backend did not load the refit as sent (see docs/training.md, Refit checks); "
                        "if the engine is right and its kernels differ more, raise refit.check.probe_tolerance")
