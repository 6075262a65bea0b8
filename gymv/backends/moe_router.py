"""Mixture-of-experts routers under training: their load-balancing terms, logged every step and configurable
(`training.moe`).

Nemotron 3's routers score experts with a sigmoid and pick the top k after adding a per-expert correction
bias (`e_score_correction_bias`), which balances load without a loss term: after each step the bias of an
expert that took fewer tokens than the mean goes up by a fixed rate, that of a busier one down. transformers
computes neither that update nor an auxiliary loss, so gymv does both here:

- `train/moe_aux_loss`: the load-balancing loss `E * sum_i f_i * P_i`, averaged over MoE layers, where `f_i`
  is expert i's share of the routed token slots and `P_i` its mean normalised score over the micro-batch's
  real tokens (1.0 when perfectly balanced, E when every token goes to one expert). With
  `training.moe.aux_loss_coef` > 0 it is added to the loss (the gradient reaches the router through `P`).
- `train/moe_load_max`: the busiest expert's share of slots times E, the worst layer (1.0 = balanced).
- `training.moe.router_bias_update_rate` > 0: the aux-loss-free update of the correction bias after each
  optimizer step, from the step's loads summed over data-parallel ranks (every rank applies the same
  update; `train/moe_bias_absmax` is logged). 0, the default, keeps the bias frozen, as RL recipes do.

Under Megatron's model parallelism (the decoder's `router_replica`, a `RouterReplica`) the terms are the
replica's, as one rank would compute them: context-parallel ranks route different positions of the same rows,
so their slot counts, score sums and token counts are summed over the CP group (each rank's padding mask cut
to its own positions), every rank logs the whole rows' figures and counts the step's loads once, and the aux
term's gradient reaches the router through this rank's own scores alone (its value is the whole rows', its
gradient this rank's part, which the trainer's sum over CP ranks completes, as for the loss); tensor-parallel
ranks route the same tokens and sum the router's gradient over TP, so each adds 1/TP of the aux gradient.

The terms cover the tokens the forward pass routes: a GRPO group's shared prompt counts once per sample in
packed rows and unshared padded rows, once on the padded shared-prompt path.
Routers are recorded by forward hooks while the training forward runs (not during the recomputation of
activation checkpointing, nor in logprob-only passes); the padding of each call is read from the 2-D
attention mask its decoder receives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gymv.errors import GymvError
from gymv.sections import MoeSection

# forward returns (logits, top-k weights, top-k indices); sigmoid scores. HybridTopkRouter: the Megatron
# backend's (gymv.backends.training.megatron_hybrid), whose MegatronCausalLM / MegatronVLM take the HF call
ROUTERS = ("NemotronHTopkRouter", "HybridTopkRouter")
# where each call's padding mask is read (their subclasses too: the context-parallel Megatron wrappers)
DECODERS = ("NemotronHModel", "MegatronCausalLM", "MegatronVLM")


@dataclass(frozen=True)
class RouterReplica:
    """How this rank's routers share their model replica's tokens with other ranks (one rank: nothing shared).
    `tensor`: the ranks routing the same tokens whose router gradients the trainer sums; `context_group`: the
    ranks routing other positions of the same rows, `positions(length)` this rank's positions of a row of
    that length (padded: those at `length` or beyond are padding)."""

    tensor: int = 1
    context_group: Any = None
    positions: Callable[[int], torch.Tensor] | None = None


def _is_decoder(module: torch.nn.Module) -> bool:
    return any(c.__name__ in DECODERS for c in type(module).__mro__)


class _Layer:
    """One router's sums over the calls of one forward pass (a shared-prompt pass calls it twice)."""

    def __init__(self, experts: int, device: torch.device):
        self.experts = experts
        self.tokens = 0
        self.slots = torch.zeros(experts, device=device)  # routed slots per expert [E]
        self.scores = torch.zeros(experts, device=device)  # normalised scores summed over tokens [E]

    def add(self, logits: torch.Tensor, index: torch.Tensor, mask: torch.Tensor | None) -> None:
        if mask is not None:
            logits, index = logits[mask], index[mask]
        if logits.shape[0] == 0:
            return
        scores = logits.float().sigmoid()
        probs = scores / scores.sum(-1, keepdim=True)
        self.slots = self.slots.index_add(0, index.reshape(-1), torch.ones(index.numel(), device=index.device))
        self.scores = self.scores + probs.sum(0)
        self.tokens += int(logits.shape[0])


def _aux(experts: int, top_k: int, slots: torch.Tensor, scores: torch.Tensor, tokens) -> torch.Tensor:
    f = slots / (tokens * top_k)
    return experts * (f * (scores / tokens)).sum()


class RouterTerms:
    """The routers of one model; `attach` returns None for a model without any."""

    def __init__(self, model: torch.nn.Module, routers: list, settings: MoeSection):
        self.routers = routers
        self.settings = settings
        self.armed = False
        self._mask: torch.Tensor | None = None
        self._calls: list[tuple] = []  # (router, logits, top-k indices, padding mask) of the recorded pass
        self._step_slots: dict[int, torch.Tensor] = {}
        for i, r in enumerate(routers):
            r.register_forward_hook(self._router_hook(i))
        decoders = [m for m in model.modules() if _is_decoder(m)]
        for m in decoders:
            m.register_forward_pre_hook(self._decoder_hook, with_kwargs=True)
        self.replica = next((m.router_replica() for m in decoders if hasattr(m, "router_replica")), RouterReplica())

    @classmethod
    def attach(cls, model: torch.nn.Module, settings: MoeSection) -> RouterTerms | None:
        """The terms of `model`'s routers (None without any); with `freeze_router` their weights leave training
        here, before any trainer collects or shards the parameters."""
        routers = [m for m in model.modules() if type(m).__name__ in ROUTERS]
        if settings.freeze_router:
            if not routers:
                raise GymvError("training.moe.freeze_router is set, but this model has no mixture-of-experts router",
                                where="training.moe.freeze_router", fix="remove it (or set it false) for this model")
            for r in routers:
                r.weight.requires_grad_(False)
        return cls(model, routers, settings) if routers else None

    # -- recording --------------------------------------------------------------------------------------
    def _decoder_hook(self, module, args, kwargs):
        if not self.armed:
            return None
        mask = kwargs.get("attention_mask")
        x = kwargs.get("inputs_embeds")
        x = x if x is not None else kwargs.get("input_ids", args[0] if args else None)
        mask = mask[:, -x.shape[1]:].bool() if mask is not None and mask.ndim == 2 and x is not None else None
        if self.replica.positions is not None and x is not None:  # this CP rank's positions; beyond the row: padding
            length = x.shape[1]
            at = self.replica.positions(length).to(x.device)
            real = (at < length).expand(x.shape[0], -1)
            mask = real if mask is None else mask[:, at.clamp(max=length - 1)] & real
        self._mask = mask.reshape(-1) if mask is not None else None
        return None

    def _router_hook(self, i: int):
        def hook(module, args, out):
            # only references here: an operation inside a checkpointed layer would save tensors that its
            # recomputation (which records nothing) does not
            if self.armed:
                logits, _, index = out
                mask = self._mask if self._mask is not None and self._mask.numel() == logits.shape[0] else None
                self._calls.append((i, logits, index, mask))
        return hook

    def wrap_logprob(self, fn: Callable) -> Callable:
        """The trainer's logprob function, recording the routers of its forward pass."""
        def wrapped(model, mb):
            self._calls, self._mask, self.armed = [], None, True
            try:
                return fn(model, mb)
            finally:
                self.armed = False
        return wrapped

    def _take_layers(self) -> list[tuple[int, _Layer]]:
        layers: dict[int, _Layer] = {}
        for i, logits, index, mask in self._calls:
            layers.setdefault(i, _Layer(logits.shape[-1], logits.device)).add(logits, index, mask)
        self._calls = []
        return sorted(layers.items())

    def _balance(self, layers: list[tuple[int, _Layer]]) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(router, aux loss, slots) of each layer that routed a real token of the replica's rows: the aux
        loss's value the rows', its gradient this rank's share (module docstring)."""
        replica = self.replica
        if not layers:
            return []
        slots = [layer.slots for _, layer in layers]
        scores = [layer.scores.detach() for _, layer in layers]
        tokens = [float(layer.tokens) for _, layer in layers]
        if replica.context_group is not None:  # one collective: every layer's slots, scores and tokens
            import torch.distributed as dist

            flat = torch.cat([*slots, *scores, torch.tensor(tokens, device=slots[0].device)])
            dist.all_reduce(flat, group=replica.context_group)
            sizes = [s.numel() for s in slots]
            parts = flat.split([*sizes, *sizes, len(tokens)])
            slots, scores, tokens = list(parts[:len(sizes)]), list(parts[len(sizes):-1]), parts[-1].tolist()
        out = []
        for (i, layer), s, p, n in zip(layers, slots, scores, tokens):
            if n == 0:
                continue
            top_k = self.routers[i].top_k
            mine = _aux(layer.experts, top_k, s, layer.scores, n)  # one rank alone: the value and gradient
            aux = _aux(layer.experts, top_k, s, p, n) + (mine - mine.detach()) / replica.tensor
            out.append((i, aux, s))
        return out

    # -- loss and metrics ---------------------------------------------------------------------------------
    def wrap_loss(self, loss_fn: Callable) -> Callable:
        """`loss_fn` plus the load-balancing term (weighted by the micro-batch's share of the step's loss
        tokens, so its sum over micro-batches is the step's mean) and the router metrics."""
        def wrapped(mb, logp, entropy, counts, **extra):
            loss, metrics = loss_fn(mb, logp, entropy, counts, **extra)
            layers = self._balance(self._take_layers())
            if not layers:
                return loss, metrics
            aux = torch.stack([a for _, a, _ in layers]).mean()
            # a tensor: a float here would wait on the device between each micro-batch's forward and backward
            share = mb["loss_mask"].sum().to(aux.dtype) / max(counts.tokens, 1.0)
            if self.settings.aux_loss_coef > 0:
                loss = loss + self.settings.aux_loss_coef * (share * aux).to(loss.dtype)
            load = torch.stack([s.max() * s.numel() / s.sum() for _, _, s in layers]).max()
            for i, _, s in layers:
                self._step_slots[i] = self._step_slots.get(i, 0) + s.detach()
            metrics = {**metrics, "moe_aux_loss": aux.detach() * share, "moe_load_max": load.detach()}
            return loss, metrics
        return wrapped

    def end_step(self, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """After an applied optimizer step: the aux-loss-free bias update (when its rate is set)."""
        slots, self._step_slots = self._step_slots, {}
        rate = self.settings.router_bias_update_rate
        if rate <= 0 or not slots:
            return {}
        order = sorted(slots)
        load = sum_over_ranks(torch.stack([slots[i] for i in order]))  # [layers, E], every rank the same
        with torch.no_grad():
            for row, i in zip(load, order):
                bias = self.routers[i].e_score_correction_bias
                bias.add_(rate * torch.sign(row.mean() - row).to(bias.device, bias.dtype))
        return {"train/moe_bias_absmax": max(float(self.routers[i].e_score_correction_bias.abs().max()) for i in order)}
