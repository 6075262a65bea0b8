"""Generation backends: sample continuations from token ids + images, with per-token logprobs."""

from gymv.backends.generation.base import GenerationBackend, GenerationOutput, GenerationRequest, SamplingParams

__all__ = ["GenerationBackend", "GenerationOutput", "GenerationRequest", "SamplingParams"]
