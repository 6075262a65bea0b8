"""The methods gymv adds to each vLLM worker (vLLM's `worker_extension_cls`), called by `collective_rpc`.

Every path ends in the worker's own `reload_weights`, which runs the model's weight loader (checkpoint names
in, vLLM's fused and repacked parameters out) and its post-load processing; writing into the parameters
directly is wrong on vLLM's CPU build, which repacks linear weights after loading. After it, the Mamba-2
mixers' convolution alias is refreshed (`_gymv_refresh_conv_aliases`: vLLM's reload leaves it stale where
it prepacks bfloat16 convolutions).

| method | weights arrive as | run here |
|---|---|---|
| gymv_load_weights | (name, tensor) pairs in the call (in-process engine) | yes, CPU |
| gymv_load_weights_file | a safetensors file, usually under /dev/shm (engine in other processes) | yes, CPU |
| gymv_load_weights_ipc | CUDA IPC handles of the trainer's flat buffer on the same GPU | no: written for GPUs, not run |
| gymv_init_weight_group / gymv_load_weights_broadcast | an NCCL broadcast from trainer rank 0 | no: written for GPUs, not run |

This module imports nothing from vLLM at import time, so the worker process resolves it cheaply.
"""

from __future__ import annotations

from typing import Any


class GymvWeightSync:
    """Mixed into vLLM's worker class: `self` is the worker (`self.device`, `self.model_runner`)."""

    def _gymv_reload(self, pairs, direct: dict[str, str] | None = None) -> None:
        """`direct`: checkpoint name -> the model's parameter, for weights a model's own loader writes past
        the parameters' weight loaders, which vLLM's in-place reload then restores to their old values (plain
        torch layers, which vLLM does not repack, so a copy is the load)."""
        import torch

        pairs = list(pairs)
        self.reload_weights(weights_iterator=iter(pairs))  # type: ignore[attr-defined]
        self._gymv_refresh_conv_aliases()
        if direct:
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            with torch.no_grad():
                for name, tensor in pairs:
                    if name in direct:
                        param = model.get_parameter(direct[name])
                        param.copy_(tensor.to(device=param.device, dtype=param.dtype))

    def _gymv_refresh_conv_aliases(self) -> int:
        """vLLM's Mamba-2 mixer convolves through `conv_weights`, a buffer made at build time as a view of
        `conv1d.weight`. Where vLLM prepacks bfloat16 convolution weights (CPUs with AVX-512 BF16 or Arm BF16),
        the prepack points `conv1d.weight` at new, packed storage, and the in-place reload copies the next
        weights into that storage alone: the buffer keeps the first weights, so the engine convolves with
        stale weights while every other layer has the new ones (vLLM 0.32). Copy the new unpacked weight into
        the buffer; where the buffer still is a view of the weight, nothing is stale and nothing is copied.
        Returns how many buffers were refreshed."""
        import torch

        refreshed = 0
        with torch.no_grad():
            for module in self.model_runner.get_model().modules():  # type: ignore[attr-defined]
                alias, conv = module._buffers.get("conv_weights"), getattr(module, "conv1d", None)
                if alias is None or conv is None:
                    continue
                source = getattr(conv, "_cpu_unpacked_conv_weight", None)
                if source is None and conv.weight.dim() == 3 and conv.weight.shape[1] == 1:
                    source = conv.weight.view(conv.weight.shape[0], conv.weight.shape[2])
                if source is None or source.shape != alias.shape or source.data_ptr() == alias.data_ptr():
                    continue
                alias.copy_(source)
                refreshed += 1
        return refreshed

    def gymv_load_weights(self, weights: list[tuple[str, Any]], direct: dict[str, str] | None = None) -> None:
        self._gymv_reload(weights, direct)

    def gymv_load_weights_file(self, path: str, direct: dict[str, str] | None = None) -> None:
        from safetensors.torch import load_file

        self._gymv_reload(load_file(path).items(), direct)

    def gymv_load_weights_ipc(self, handles: dict, layout) -> None:
        """Rebuild the trainer's flat CUDA buffer from its IPC handle (keyed by GPU uuid) and load views of it."""
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        uuid = str(torch.cuda.get_device_properties(self.device).uuid)  # type: ignore[attr-defined]
        func_args = list(handles[uuid])
        func_args[6] = self.device.index  # type: ignore[attr-defined]  # the receiving process's device
        flat = rebuild_cuda_tensor(*func_args)
        self._gymv_reload(_views(flat, layout))
        torch.cuda.synchronize(self.device)  # type: ignore[attr-defined]

    def gymv_init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int) -> None:
        """Join the trainer's weight broadcast group as rank `rank_offset + this worker's rank`."""
        import torch.distributed as dist

        rank = rank_offset + int(getattr(self, "rank", 0))
        store = dist.TCPStore(host, port, world_size, is_master=False)
        group = dist.ProcessGroupNCCL(dist.PrefixStore("gymv-refit", store), rank, world_size)
        self._gymv_group = group  # type: ignore[attr-defined]

    def gymv_load_weights_broadcast(self, layout, spans=None) -> None:
        """Receive the buckets that trainer rank 0 broadcasts (the `spans` of its rendezvous info) into one
        flat buffer, then its status flag; load views of the buffer only if the sender finished."""
        import torch

        flat = torch.empty(layout.numel, dtype=layout.torch_dtype, device=self.device)  # type: ignore[attr-defined]
        for start, stop in spans or [(0, layout.numel)]:
            self._gymv_group.broadcast(flat[start:stop], 0).wait()  # type: ignore[attr-defined]
        status = torch.zeros(1, dtype=torch.int32, device=self.device)  # type: ignore[attr-defined]
        self._gymv_group.broadcast(status, 0).wait()  # type: ignore[attr-defined]
        if int(status.item()) != 1:
            raise RuntimeError("refit: the trainer failed midway through sending the weights; none were loaded")
        self._gymv_reload(_views(flat, layout))


def _views(flat, layout) -> list[tuple[str, Any]]:
    """(name, view of `flat`) for every entry of a gymv.cluster.refit.WeightLayout, tied names included
    (read by attribute: the backends package does not import the cluster package)."""
    out = {name: flat[offset:offset + numel].view(shape) for name, shape, offset, numel in layout.entries}
    for alias, canonical in layout.aliases:
        out[alias] = out[canonical]
    return list(out.items())
