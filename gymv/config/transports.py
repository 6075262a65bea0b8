"""Refit transports (how new weights reach the generation backend) and what each can do.

Compatibility rules read this registry instead of hard-coding names, so a transport added by a backend or a
plugin is checked the same way: e.g. `reset_encoder_cache_after_weight_update` needs `resets_encoder_cache`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RefitTransport:
    name: str
    resets_encoder_cache: bool  # clears the vision encoder's feature cache after a successful refit
    needs_gpu: bool = False
    colocated_only: bool = False  # both sides must share the GPUs (e.g. CUDA IPC handles)
    single_node_only: bool = False  # both sides must share a host (e.g. shared memory)
    # A generator that lags behind still reads whole weights: each publish is its own object, or the sender
    # waits for the receivers. A buffer that the next publish overwrites is not (async GRPO needs this).
    lag_safe: bool = True
    shares_gpus: bool = True  # several receivers may sit on one GPU (cluster.generation_workers_per_gpu > 1)
    description: str = ""


REFIT_TRANSPORTS: dict[str, RefitTransport] = {}
AUTO_TRANSPORT = "auto"  # refit.transport: chosen at start from where the workers are (gymv.cluster.transport_choice)


def register_refit_transport(transport: RefitTransport, *, replace: bool = False) -> RefitTransport:
    if transport.name in REFIT_TRANSPORTS and not replace:
        raise ValueError(f"refit transport {transport.name!r} is already registered")
    REFIT_TRANSPORTS[transport.name] = transport
    return transport


def unregister_refit_transport(name: str) -> None:
    REFIT_TRANSPORTS.pop(name, None)


for _t in (
    RefitTransport("object_store", True, description="weights go through the Ray object store; works anywhere, CPU included"),
    RefitTransport("shm", True, single_node_only=True, lag_safe=False, description="POSIX shared memory between processes of one host"),
    RefitTransport("cuda_ipc", True, needs_gpu=True, colocated_only=True, lag_safe=False, shares_gpus=False,
                   description="CUDA IPC handles: zero-copy when training and generation share the GPUs"),
    RefitTransport("nccl", True, needs_gpu=True, shares_gpus=False, description="NCCL broadcast from trainer ranks to generation workers"),
    RefitTransport("collective", True, description="broadcast over a gloo process group of its own (the nccl transport on CPUs)"),
):
    register_refit_transport(_t)
