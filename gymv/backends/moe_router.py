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

The terms cover the tokens the forward pass routes: a GRPO group's shared prompt counts once per sample in
packed rows and unshared padded rows, once on the padded shared-prompt path.
Routers are recorded by forward hooks while the training forward runs (not during the recomputation of
activation checkpointing, nor in logprob-only passes); the padding of each call is read from the 2-D
attention mask its decoder receives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gymv.sections import MoeSection

# forward returns (logits, top-k weights, top-k indices); sigmoid scores. HybridTopkRouter: the Megatron
# backend's (gymv.backends.training.megatron_hybrid), whose MegatronCausalLM / MegatronVLM take the HF call
ROUTERS = ("NemotronHTopkRouter", "HybridTopkRouter")
DECODERS = ("NemotronHModel", "MegatronCausalLM", "MegatronVLM")  # where each call's padding mask is read


class _Layer:
    """One router's sums over the calls of one forward pass (a shared-prompt pass calls it twice)."""

    def __init__(self, experts: int):
        self.experts = experts
        self.tokens = 0
        self.slots: torch.Tensor | None = None  # routed slots per expert [E]
        self.scores: torch.Tensor | None = None  # normalised scores summed over tokens [E]

    def add(self, logits: torch.Tensor, index: torch.Tensor, mask: torch.Tensor | None) -> None:
        if mask is not None:
            logits, index = logits[mask], index[mask]
        if logits.shape[0] == 0:
            return
        scores = logits.float().sigmoid()
        probs = scores / scores.sum(-1, keepdim=True)
        slots = torch.zeros(self.experts, device=index.device).index_add_(
            0, index.reshape(-1), torch.ones(index.numel(), device=index.device))
        self.slots = slots if self.slots is None else self.slots + slots
        self.scores = probs.sum(0) if self.scores is None else self.scores + probs.sum(0)
        self.tokens += int(logits.shape[0])

    def aux(self, top_k: int) -> torch.Tensor:
        f = self.slots / (self.tokens * top_k)
        return self.experts * (f * (self.scores / self.tokens)).sum()


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
        for m in model.modules():
            if type(m).__name__ in DECODERS:
                m.register_forward_pre_hook(self._decoder_hook, with_kwargs=True)

    @classmethod
    def attach(cls, model: torch.nn.Module, settings: MoeSection) -> RouterTerms | None:
        routers = [m for m in model.modules() if type(m).__name__ in ROUTERS]
        return cls(model, routers, settings) if routers else None

    # -- recording --------------------------------------------------------------------------------------
    def _decoder_hook(self, module, args, kwargs):
        if not self.armed:
            return None
        mask = kwargs.get("attention_mask")
        x = kwargs.get("inputs_embeds")
        x = x if x is not None else kwargs.get("input_ids", args[0] if args else None)
        if mask is None or mask.ndim != 2 or x is None:
            self._mask = None
        else:
            self._mask = mask[:, -x.shape[1]:].reshape(-1).bool()
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
            layers.setdefault(i, _Layer(logits.shape[-1])).add(logits, index, mask)
        self._calls = []
        return [(i, layer) for i, layer in sorted(layers.items()) if layer.tokens]

    # -- loss and metrics ---------------------------------------------------------------------------------
    def wrap_loss(self, loss_fn: Callable) -> Callable:
        """`loss_fn` plus the load-balancing term (weighted by the micro-batch's share of the step's loss
        tokens, so its sum over micro-batches is the step's mean) and the router metrics."""
        def wrapped(mb, logp, entropy, counts, **extra):
            loss, metrics = loss_fn(mb, logp, entropy, counts, **extra)
            layers = self._take_layers()
            if not layers:
                return loss, metrics
            aux = torch.stack([layer.aux(self.routers[i].top_k) for i, layer in layers]).mean()
            share = float(mb["loss_mask"].sum()) / max(counts.tokens, 1.0)
            if self.settings.aux_loss_coef > 0:
                loss = loss + self.settings.aux_loss_coef * share * aux.to(loss.dtype)
            load = torch.stack([layer.slots.max() * layer.experts / layer.slots.sum() for _, layer in layers]).max()
            for i, layer in layers:
                self._step_slots[i] = self._step_slots.get(i, 0) + layer.slots.detach()
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
