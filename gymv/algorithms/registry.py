"""The algorithms' named choices (name -> function), open to registration in the manner of verl's
`register_adv_est`: advantage baselines (`grpo.advantage.baseline`), KL estimators (`grpo.loss.kl_estimator`)
and loss aggregations (`sft.aggregation`, `grpo.loss.aggregation`). The schema's allowed values
are these registries' names, so a registered function becomes a valid recipe value.

Built-ins are named by import path, so the schema reads their names without importing torch. A plugin
registers in its own module::

    from gymv.algorithms.registry import register_kl_estimator

    @register_kl_estimator("abs")
    def abs_kl(logp, logp_ref):  # per-token [B,T]; gymv masks the result
        return (logp - logp_ref).abs()

or through the entry-point group of the registry. The losses run in the training workers, which find a
function registered in the driver alone by its import path (`portable`), so its module must import there.
"""

from __future__ import annotations

from collections.abc import Callable

from gymv.registry import Registry

# (rewards [N] float64, group_ids [N], valid [N] bool, *, std: "unbiased" | "population") ->
# (baseline [N], std [N], has_baseline [N] bool); gymv.algorithms.advantages.grpo_advantages subtracts and scales
BASELINES = Registry("advantage baseline", "gymv.advantage_baselines", {
    "leave_one_out": "gymv.algorithms.advantages:leave_one_out",
    "mean": "gymv.algorithms.advantages:group_mean",
}, where="grpo.advantage.baseline")
# (logp [B,T], logp_ref [B,T]) -> per-token estimate of KL(pi || pi_ref) [B,T], both zero off the mask
KL_ESTIMATORS = Registry("KL estimator", "gymv.kl_estimators", {
    "k1": "gymv.algorithms.losses:kl_k1",
    "k2": "gymv.algorithms.losses:kl_k2",
    "k3": "gymv.algorithms.losses:kl_k3",
}, where="grpo.loss.kl_estimator")
# (per_token [B,T] zero off the mask, mask [B,T] bool, counts: GlobalCounts of the global batch) -> scalar loss
LOSS_AGGREGATIONS = Registry("loss aggregation", "gymv.loss_aggregations", {
    "token_mean": "gymv.algorithms.losses:token_mean",
    "seq_mean_token_mean": "gymv.algorithms.losses:seq_mean_token_mean",
    "seq_mean_token_sum": "gymv.algorithms.losses:seq_mean_token_sum",
}, where="aggregation")


def _decorator(registry: Registry, name: str) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        registry.register(name, fn)
        return fn
    return register


def register_baseline(name: str) -> Callable[[Callable], Callable]:
    """Register an advantage baseline under `name` (a valid `grpo.advantage.baseline` from then on)."""
    return _decorator(BASELINES, name)


def register_kl_estimator(name: str) -> Callable[[Callable], Callable]:
    """Register a KL estimator under `name` (a valid `grpo.loss.kl_estimator` from then on)."""
    return _decorator(KL_ESTIMATORS, name)


def register_aggregation(name: str) -> Callable[[Callable], Callable]:
    """Register a loss aggregation under `name` (a valid `aggregation` value from then on)."""
    return _decorator(LOSS_AGGREGATIONS, name)
