"""One forward pass of a transformers VLM with precomputed image features, across transformers 5.x.

gymv computes image features itself (to cache them by image hash) and writes them into the token
embeddings at the placeholder positions, then calls the model with `inputs_embeds`. This uses only
interfaces every 5.x release has; the keyword that carries the KV cache was renamed from
`past_key_values` to `cache` within 5.x, and is chosen from the model's signature. A keyword a model does
not know would vanish into its `**kwargs` silently, which is why nothing here relies on newer names.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def _params(cls) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def cache_keyword(model) -> str:
    return "cache" if "cache" in _params(type(model)) else "past_key_values"


RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "mamba", "mamba2"})


def has_recurrent_layers(model) -> bool:
    """The decoder holds recurrent layers (Mamba-2): their cached state is a running summary of every token
    passed, pads included, not a table of per-position keys."""
    text = model.config.get_text_config()
    kinds = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or ()
    return bool(RECURRENT_LAYER_TYPES & set(kinds))


def output_head(model) -> torch.nn.Module | None:
    """The LM head; a composite model that keeps it inside its language model (Nemotron 3 Omni) returns None
    from its own `get_output_embeddings`, so the language model is asked next."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inner = getattr(model, "language_model", None)
    if head is None and inner is not None and hasattr(inner, "get_output_embeddings"):
        head = inner.get_output_embeddings()
    return head


def select_cache_rows(cache, rows: torch.Tensor) -> None:
    """Keep `rows` of every layer's cache, in that order (hybrid caches: recurrent layers hold conv and SSM
    states, which transformers reorders with `reorder_cache` and has no `batch_select_indices` for)."""
    for layer in cache.layers:
        if hasattr(layer, "batch_select_indices"):
            layer.batch_select_indices(rows)
        else:
            layer.reorder_cache(rows)


def embed_with_images(model, input_ids: torch.Tensor, image_token_id: int, features: list[torch.Tensor]) -> torch.Tensor:
    """Token embeddings with each image's features written over its placeholder tokens, in order."""
    embeds = model.get_input_embeddings()(input_ids)
    if not features:
        return embeds
    feats = torch.cat([f.reshape(-1, embeds.shape[-1]) for f in features]).to(embeds.device, embeds.dtype)
    mask = input_ids == image_token_id
    # a gather by running count instead of masked_scatter: its backward (masked_select) waits on the GPU
    # for the number of placeholders; this one launches without a host sync in either direction
    source = (mask.flatten().cumsum(0) - 1).clamp(min=0).view(mask.shape)
    return torch.where(mask.unsqueeze(-1), feats[source], embeds)


def forward_logits(model, *, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                   image_token_id: int | None = None, features: list[torch.Tensor] | None = None,
                   cache=None, logits_to_keep: int | torch.Tensor | None = None,
                   extra: dict | None = None, adapter=None) -> torch.Tensor:
    """Logits of the model's own forward; `logits_to_keep` (the last k positions, or a 1-D tensor of columns)
    is passed on where the model takes it, so the LM head runs on those positions only; a model without it
    returns every position. `extra`: the adapter's `forward_kwargs` (e.g. Gemma 3's token_type_ids);
    `adapter`: where given, its `feature_inputs` carry the image features (Qwen3-VL's deepstack), else they are
    written into the token embeddings."""
    kwargs = {"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": cache is not None,
              **(extra or {})}
    if cache is not None:
        kwargs[cache_keyword(model)] = cache
    keep = logits_to_keep is not None and (isinstance(logits_to_keep, torch.Tensor) or logits_to_keep > 0)
    if keep and "logits_to_keep" in _params(type(model)):
        kwargs["logits_to_keep"] = logits_to_keep
    if features and adapter is not None and hasattr(adapter, "feature_inputs"):
        kwargs.update(adapter.feature_inputs(model, input_ids, features))
    elif features:
        kwargs["inputs_embeds"] = embed_with_images(model, input_ids, image_token_id, features)
    else:
        kwargs["input_ids"] = input_ids
    return model(**kwargs).logits
