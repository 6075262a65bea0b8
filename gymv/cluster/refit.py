"""Weight refit: the trainer's new weights reach the generation backend after each optimizer step.

Every transport moves one flat buffer (whole, or in buckets) plus a `WeightLayout` (name, shape, offset of
each tensor), so a receiver rebuilds views into the buffer and copies them into its live parameters with one
pass. The
sender casts to the generation dtype while flattening (bf16 generation gets half the bytes).

| transport | sender (training rank 0) | receiver (each generation worker) |
|---|---|---|
| object_store | one numpy array per bucket put into Ray's object store (zero-copy reads on the host) | views of them |
| shm | flat buffer written into one POSIX shared-memory segment, reused every step | views of the segment |
| cuda_ipc | flat CUDA buffer, shared by a CUDA IPC handle (same GPU, no copy through the host) | views of it |
| nccl | CUDA buckets broadcast over a dedicated NCCL group (trainer rank 0 + receivers) | its own flat buffer |

With several training ranks, object_store and collective (nccl) ship from all of them (`shares_sending`):
bucket k goes out from rank k mod R (into the object store of that rank's node; or broadcast in a group of
that rank and the receivers), and each receiver joins the ranks' shares; shm and cuda_ipc send from rank 0.

The `collective` implementation behind `nccl` also runs on gloo (CPU), which is how it is tested here.
Encoder-cache resets are the receiver's caller's job (GenerationWorker), after a refit that succeeded.

Buckets (`refit.bucket_mb`): object_store and collective ship the flat buffer in fixed-size slices of the
layout as each fills (a tensor may span several), so the trainer holds two bucket buffers and one gathered
tensor, not the model: the previous bucket is sent (a background `ray.put`, an async broadcast) while the
next one fills. shm and cuda_ipc write into the buffer the receivers map, which is itself the model's size,
so they ship once. Receivers stage every bucket and load them in one `update_weights` at the end: a refit
that fails midway loads nothing (a collective sender that fails still completes the broadcasts and then
broadcasts an abort flag, so its receivers raise instead of waiting).
"""

from __future__ import annotations

import bisect
import os
import uuid
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from gymv.backends.generation.base import Weights, named
from gymv.backends.registry import REFIT_TRANSPORTS
from gymv.backends.weights import weights_hash  # noqa: F401  (its old home)
from gymv.errors import GymvError
from gymv.net import master_store


# ------------------------------------------------------------------------------------------------ layout


@dataclass(frozen=True)
class WeightLayout:
    """Where each tensor lives in the flat buffer; `aliases` are tied names that share a tensor."""

    entries: tuple[tuple[str, tuple[int, ...], int, int], ...]  # (name, shape, offset, numel)
    aliases: tuple[tuple[str, str], ...]  # (alias, canonical name)
    dtype: str
    numel: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.torch_dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_layout(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> WeightLayout:
    entries, aliases, seen, offset = [], [], {}, 0
    for name, t in state_dict.items():
        key = (t.data_ptr(), tuple(t.shape), t.dtype) if t.numel() else None
        if key is not None and key in seen:
            aliases.append((name, seen[key]))
            continue
        if key is not None:
            seen[key] = name
        entries.append((name, tuple(t.shape), offset, t.numel()))
        offset += t.numel()
    first = next(iter(state_dict.values()), None)
    dt = dtype or (first.dtype if first is not None else torch.float32)
    return WeightLayout(tuple(entries), tuple(aliases), dtype_name(dt), offset)


def flatten_into(flat: torch.Tensor, state_dict: Mapping[str, torch.Tensor], layout: WeightLayout) -> torch.Tensor:
    """Copy (and cast) every tensor into its slice of `flat`: the one copy a sender makes."""
    with torch.no_grad():
        for name, _, offset, numel in layout.entries:
            flat[offset:offset + numel].copy_(state_dict[name].reshape(-1))
    return flat


def stream_into(flat: torch.Tensor, pairs, layout: WeightLayout) -> torch.Tensor:
    """Copy (and cast) each streamed (name, tensor) into its slice of `flat` as it arrives, holding none of
    them afterwards. Every name of `layout` must arrive once with its shape: weights that changed names or
    shapes since the layout was made are refused rather than sent half-updated."""
    slots = {name: (shape, offset, numel) for name, shape, offset, numel in layout.entries}
    aliases = {alias for alias, _ in layout.aliases}
    missing = set(slots)
    with torch.no_grad():
        for name, t in pairs:
            if name in aliases and name not in slots:
                continue
            slot = slots.get(name)
            if slot is None or tuple(t.shape) != slot[0]:
                raise GymvError(f"refit: weight {name!r} {tuple(t.shape)} is not in the layout of the first refit",
                                where="refit", fix="the trainer's parameters must keep their names and shapes")
            flat[slot[1]:slot[1] + slot[2]].copy_(t.reshape(-1))
            missing.discard(name)
            del t
    if missing:
        raise GymvError(f"refit: {len(missing)} weights never arrived (first: {sorted(missing)[0]!r})", where="refit",
                        fix="the trainer's parameters must keep their names and shapes")
    return flat


DEFAULT_BUCKET_MB = 256.0


def bucket_numel(layout: WeightLayout, bucket_mb: float) -> int:
    """Elements per bucket for `bucket_mb` MiB in the layout's dtype; 0 (one shot) when the model fits one."""
    if bucket_mb <= 0:
        return 0
    per = max(1, int(bucket_mb * 2**20) // torch.empty((), dtype=layout.torch_dtype).element_size())
    return 0 if per >= layout.numel else per


def bucket_spans(numel: int, per_bucket: int) -> list[tuple[int, int]]:
    """(start, stop) of each bucket: fixed-size slices of the flat layout, the last one shorter."""
    if per_bucket <= 0 or per_bucket >= numel:
        return [(0, numel)]
    return [(start, min(start + per_bucket, numel)) for start in range(0, numel, per_bucket)]


class _LayoutOrder:
    """Checks each streamed (name, tensor) against the layout's next entry (tied names are skipped)."""

    def __init__(self, layout: WeightLayout):
        self.aliases = {alias for alias, _ in layout.aliases}
        self.entries = [(name, shape) for name, shape, _, _ in layout.entries]
        self.index = {name: i for i, (name, _) in enumerate(self.entries)}
        self.next = 0

    def takes(self, name: str, t: torch.Tensor) -> bool:
        """False for a tied name to skip; raises for a weight out of place."""
        if name in self.aliases and name not in self.index:
            return False
        i = self.index.get(name)
        if i is None or tuple(t.shape) != self.entries[i][1]:
            raise GymvError(f"weight {name!r} {tuple(t.shape)} is not in the layout of the first refit",
                            where="refit", fix="the trainer's parameters must keep their names and shapes")
        if i > self.next:
            self.done()
        if i < self.next:
            raise GymvError(f"weight {name!r} arrived again or out of the order of the first refit", where="refit",
                            fix="the trainer must yield each weight once, in the same order at every refit")
        self.next += 1
        return True

    def done(self) -> None:
        if self.next < len(self.entries):
            raise GymvError(f"weights never arrived (first: {self.entries[self.next][0]!r})", where="refit",
                            fix="the trainer's parameters must keep their names and shapes")


def pack_buckets(pairs: Iterable, layout: WeightLayout, spans: list[tuple[int, int]],
                 buffer: Callable[[int, int], torch.Tensor], owned: Callable[[int], bool] = lambda k: True,
                 ) -> Iterator[tuple[int, torch.Tensor]]:
    """Copy (and cast) the streamed tensors into bucket buffers, in layout order, yielding (bucket index,
    filled buffer) as soon as each bucket is full. `buffer(k, numel)` hands out bucket k's buffer (the
    sender reuses a buffer once its earlier bucket has been sent). A tensor larger than the room left in
    a bucket continues in the next one; no gathered tensor is held past its copy. Buckets that `owned`
    refuses (another rank ships them) are skipped: nothing is copied for them."""
    order = _LayoutOrder(layout)
    k, (start, stop) = 0, spans[0]
    buf, pos = buffer(0, stop - start) if owned(0) else None, start
    with torch.no_grad():
        for name, t in pairs:
            if not order.takes(name, t):
                del t
                continue
            t = t.reshape(-1)
            i, n = 0, t.numel()
            while i < n:
                take = min(n - i, stop - pos)
                if buf is not None:
                    buf[pos - start:pos - start + take].copy_(t[i:i + take])
                i, pos = i + take, pos + take
                if pos == stop:
                    if buf is not None:
                        yield k, buf
                    k += 1
                    if k == len(spans):
                        break
                    start, stop = spans[k]
                    buf, pos = buffer(k, stop - start) if owned(k) else None, start
            del t
    order.done()
    if k < len(spans) and buf is not None:  # only an empty layout has a bucket left, itself empty
        yield k, buf


def stage_buckets(buckets: list[torch.Tensor], spans: list[tuple[int, int]],
                  layout: WeightLayout) -> dict[str, torch.Tensor]:
    """Named tensors from received buckets: views where a tensor lies in one bucket, a joined copy where it
    spans several."""
    starts = [start for start, _ in spans]
    out: dict[str, torch.Tensor] = {}
    for name, shape, offset, numel in layout.entries:
        k = bisect.bisect_right(starts, offset) - 1
        if numel == 0 or offset + numel <= spans[k][1]:
            out[name] = buckets[k][offset - spans[k][0]:offset - spans[k][0] + numel].view(shape)
            continue
        pieces, pos = [], offset
        while pos < offset + numel:
            start, stop = spans[k]
            take = min(stop, offset + numel) - pos
            pieces.append(buckets[k][pos - start:pos - start + take])
            pos, k = pos + take, k + 1
        out[name] = torch.cat(pieces).view(shape)
    for alias, canonical in layout.aliases:
        out[alias] = out[canonical]
    return out


def unflatten(flat: torch.Tensor, layout: WeightLayout) -> dict[str, torch.Tensor]:
    """Views of `flat`, one per name (tied names included): no copy."""
    out = {name: flat[offset:offset + numel].view(shape) for name, shape, offset, numel in layout.entries}
    for alias, canonical in layout.aliases:
        out[alias] = out[canonical]
    return out


# ------------------------------------------------------------------------------------------- transports


class RefitSender(ABC):
    """Lives in training rank 0; `publish` returns what the driver hands to every receiver."""

    name: str
    receiver: type[RefitReceiver]  # the class each generation worker receives with
    in_band = True  # False: receivers get the weights through the transport itself, not the returned payload
    bucketed = False  # True: ships in buckets of `bucket_mb` (`_bucket_buffer`, `_send_bucket`, `_finish`)

    shares_sending = False  # True: every training rank may ship its share of the buckets (`rank`, `senders`)

    def __init__(self, dtype: torch.dtype, device: torch.device, num_receivers: int = 1,
                 bucket_mb: float = DEFAULT_BUCKET_MB, *, rank: int = 0, senders: int = 1):
        self.dtype, self.device, self.num_receivers = dtype, torch.device(device), num_receivers
        self.bucket_mb = bucket_mb
        self.rank, self.senders = rank, senders
        self.layout: WeightLayout | None = None

    def _layout(self, state_dict) -> WeightLayout:
        layout = make_layout(state_dict, self.dtype)
        if self.layout is None or self.layout != layout:
            self.layout = layout
        return self.layout

    def spans(self, layout: WeightLayout) -> list[tuple[int, int]]:
        """The buckets this sender ships `layout` in (one for a transport that ships once)."""
        return bucket_spans(layout.numel, bucket_numel(layout, self.bucket_mb) if self.bucketed else 0)

    def rendezvous(self, weights: Weights) -> dict | None:
        """Connection info receivers need before the first refit (collective transports); else None."""
        return None

    def connect(self) -> None:
        """Join the receivers (called at the same time as every receiver's `connect`)."""

    def publish(self, weights: Weights) -> Any:
        """Send the weights: a mapping, or (name, tensor) pairs as a trainer streams them
        (`TrainingBackend.named_weights`). Once a layout is known, streamed pairs are copied into the buffer
        one at a time, so a sharded trainer's gathered tensors never all live at once."""
        if self.layout is not None and not isinstance(weights, Mapping):
            if self.bucketed:
                return self._ship_buckets(self.layout, weights)
            return self._ship(self.layout, stream_into(self._buffer(self.layout), weights, self.layout))
        return self.send(named(weights))

    def send(self, state_dict: Mapping[str, torch.Tensor]) -> Any:
        """What `publish` returns to the driver for every receiver."""
        layout = self._layout(state_dict)
        if self.bucketed:
            return self._ship_buckets(layout, ((name, state_dict[name]) for name, *_ in layout.entries))
        return self._ship(layout, flatten_into(self._buffer(layout), state_dict, layout))

    def _ship_buckets(self, layout: WeightLayout, pairs) -> Any:
        spans = self.spans(layout)
        sent = 0
        try:
            for k, filled in pack_buckets(pairs, layout, spans, self._bucket_buffer, self.owns):
                self._send_bucket(k, filled)
                sent = k + 1
        except BaseException:
            self._abort(spans, sent)
            raise
        return self._finish(layout, spans)

    def owns(self, k: int) -> bool:
        """Whether this rank ships bucket k: bucket k goes out from rank k mod `senders`."""
        return k % self.senders == self.rank

    def _buffer(self, layout: WeightLayout) -> torch.Tensor:
        """The flat buffer the weights are copied into (reused across refits where the transport allows)."""
        raise NotImplementedError

    def _ship(self, layout: WeightLayout, flat: torch.Tensor) -> Any:
        """Hand the filled buffer to the receivers; returns the payload for the driver."""
        raise NotImplementedError

    def _bucket_buffer(self, k: int, numel: int) -> torch.Tensor:
        """Bucket k's buffer, once the bucket that used it before has been sent."""
        raise NotImplementedError

    def _send_bucket(self, k: int, filled: torch.Tensor) -> None:
        """Start sending a filled bucket (it may complete in the background)."""
        raise NotImplementedError

    def _finish(self, layout: WeightLayout, spans: list[tuple[int, int]]) -> Any:
        """Wait for every bucket to be sent; returns the payload for the driver."""
        raise NotImplementedError

    def _abort(self, spans: list[tuple[int, int]], sent: int) -> None:
        """A refit failed after `sent` buckets: let go of what was sent, so no receiver loads any of it."""

    def close(self) -> None:
        """Free what the sender holds (shared memory, process groups)."""


class _DoubleBuffer:
    """Two bucket buffers: one fills while the other's bucket is being sent; a buffer is handed out again
    only after `wait` on the send that used it."""

    def __init__(self):
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.pending: list[Callable[[], Any] | None] = [None, None]

    def get(self, k: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        i = k % 2
        self.wait(i)
        buf = self.buffers[i]
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self.buffers[i] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def wait(self, i: int) -> Any:
        pending, self.pending[i] = self.pending[i], None
        return pending() if pending is not None else None

    def wait_all(self) -> None:
        for i in (0, 1):
            self.wait(i)

    @property
    def numel(self) -> int:
        """Elements held in staging buffers (the trainer's extra memory for a refit, besides one tensor)."""
        return sum(b.numel() for b in self.buffers if b is not None)

class RefitReceiver(ABC):
    """Lives in a generation worker; `receive` turns a payload into named tensors to load."""

    name: str

    def __init__(self, device: torch.device, info: dict | None = None, rank: int = 1):
        self.device, self.info, self.rank = torch.device(device), info, rank

    def connect(self) -> None: ...

    @abstractmethod
    def receive(self, payload: Any) -> dict[str, torch.Tensor]: ...

    def close(self) -> None: ...


class ObjectStoreSender(RefitSender):
    """Puts each bucket into Ray's object store as it fills (a background thread, while the next bucket fills)
    and returns their references; every receiver reads them (zero-copy on its host). Outside a Ray worker the
    buckets are plain numpy copies in the payload."""

    name = "object_store"
    bucketed = True
    shares_sending = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.staging = _DoubleBuffer()
        self._pool: ThreadPoolExecutor | None = None
        self._sent: list[Future] = []

    def _bucket_buffer(self, k, numel):
        return self.staging.get(k, numel, self.dtype, torch.device("cpu"))

    def _send_bucket(self, k, filled):
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="gymv-refit")
        future = self._pool.submit(_put, filled)
        self._sent.append(future)
        self.staging.pending[k % 2] = future.result

    def _finish(self, layout, spans):
        self.staging.wait_all()
        buckets, self._sent = [f.result() for f in self._sent], []
        if self.senders > 1:  # this rank's share: bucket k of every `senders` from `rank` on
            return {"layout": layout, "spans": spans, "buckets": buckets, "owned": [k for k in range(len(spans)) if self.owns(k)]}
        return {"layout": layout, "spans": spans, "buckets": buckets}

    def _abort(self, spans, sent):
        self._sent = []  # dropping the references frees the buckets already put
        try:
            self.staging.wait_all()
        except Exception:  # the refit's own error is the one to report
            pass

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _put(bucket: torch.Tensor):
    """The bucket's bytes in Ray's object store (a copy: the buffer is free to refill when this returns)."""
    if bucket.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the bits
        bucket = bucket.view(torch.int16)
    import ray

    if ray.is_initialized():
        return ray.put(bucket.numpy())
    return bucket.numpy().copy()


def merge_shares(parts: Sequence[dict]) -> dict:
    """One object_store payload from the shares every sending rank published (each names its buckets)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    buckets: list = [None] * len(first["spans"])
    for part in parts:
        if part["layout"] != first["layout"]:
            raise GymvError("refit: the training ranks sent different weight layouts; none were loaded",
                            where="refit (object_store)", fix="every rank must hold the same model")
        for k, ref in zip(part["owned"], part["buckets"]):
            buckets[k] = ref
    if any(b is None for b in buckets):
        raise GymvError(f"refit: {sum(b is None for b in buckets)} buckets had no sender; none were loaded",
                        where="refit (object_store)", fix="see the training workers' errors")
    return {"layout": first["layout"], "spans": first["spans"], "buckets": buckets}


class ObjectStoreReceiver(RefitReceiver):
    name = "object_store"

    def receive(self, payload):
        import ray

        if isinstance(payload, (list, tuple)):  # shares of several sending ranks
            payload = merge_shares(payload)

        layout: WeightLayout = payload["layout"]
        spans = payload["spans"]
        if len(payload["buckets"]) != len(spans):
            raise GymvError(f"refit: {len(payload['buckets'])} buckets arrived, the layout has {len(spans)}; "
                            "none were loaded", where="refit (object_store)", fix="see the training worker's error")
        buckets = []
        for k, bucket in enumerate(payload["buckets"]):
            if isinstance(bucket, ray.ObjectRef):
                bucket = ray.get(bucket)
            with warnings.catch_warnings():  # Ray hands out read-only arrays; they are only read here
                warnings.simplefilter("ignore")
                flat = torch.from_numpy(bucket)
            if layout.torch_dtype == torch.bfloat16:
                flat = flat.view(torch.bfloat16)
            if flat.numel() != spans[k][1] - spans[k][0]:
                raise GymvError(f"refit: bucket {k} holds {flat.numel()} elements, its slice of the layout "
                                f"{spans[k][1] - spans[k][0]}; none were loaded", where="refit (object_store)",
                                fix="the sender and receivers must run the same gymv")
            buckets.append(flat.to(self.device))
        return stage_buckets(buckets, spans, layout)


def _untrack_shm(shm) -> None:
    """Python < 3.13 registers an *attached* segment with the resource tracker, which then unlinks it when
    the attaching process exits; only the creator may own it."""
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:
        pass


SHM_PREFIX = "gymv-refit-"
SHM_DIR = "/dev/shm"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphaned_segments(directory: str = SHM_DIR) -> list[str]:
    """Unlink refit segments whose creating process is gone (a trainer killed with SIGKILL never unlinks its
    segment, which holds a full copy of the weights); returns their names. Segments are named
    gymv-refit-<creator pid>-<random>; a live creator's segment is never touched."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(SHM_PREFIX):
            continue
        pid = name[len(SHM_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except OSError:
                pass
    return removed


class ShmSender(RefitSender):
    """One shared-memory segment, created on the first refit and rewritten in place every step. Creating
    one first removes the segments of dead trainers (an earlier run killed with SIGKILL)."""

    name = "shm"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._shm = None

    def _buffer(self, layout):
        from multiprocessing import shared_memory

        if self._shm is None or self._shm.size < layout.nbytes:
            self.close()
            remove_orphaned_segments()
            self._shm = shared_memory.SharedMemory(name=f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}", create=True,
                                                   size=max(layout.nbytes, 1))
        return torch.frombuffer(self._shm.buf, dtype=layout.torch_dtype, count=layout.numel)

    def _ship(self, layout, flat):
        return {"layout": layout, "name": self._shm.name}

    def close(self) -> None:
        if self._shm is not None:
            try:
                self._shm.close()
                self._shm.unlink()
            except (FileNotFoundError, BufferError):
                pass
            self._shm = None


class ShmReceiver(RefitReceiver):
    name = "shm"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._shm = None

    def receive(self, payload):
        from multiprocessing import shared_memory

        layout: WeightLayout = payload["layout"]
        if self._shm is None or self._shm.name != payload["name"]:
            self.close()
            try:
                self._shm = shared_memory.SharedMemory(name=payload["name"])
            except FileNotFoundError:
                raise GymvError(f"shared-memory segment {payload['name']!r} not found", where="refit (shm)",
                                fix="refit.transport shm needs training and generation on one host; use object_store") from None
            _untrack_shm(self._shm)
        flat = torch.frombuffer(self._shm.buf, dtype=layout.torch_dtype, count=layout.numel)
        return unflatten(flat if self.device.type == "cpu" else flat.to(self.device), layout)

    def close(self) -> None:
        if self._shm is not None:
            try:
                self._shm.close()
            except BufferError:  # a view is still alive; the mapping goes with the process
                pass
            self._shm = None


class CudaIpcSender(RefitSender):
    """A flat CUDA buffer shared by IPC handle; it stays alive here until the next publish."""

    name = "cuda_ipc"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._flat: torch.Tensor | None = None

    def _buffer(self, layout):
        if self.device.type != "cuda":
            raise GymvError("refit transport cuda_ipc needs the trainer on a GPU", where="refit.transport",
                            fix="use object_store or shm on CPU")
        if self._flat is None or self._flat.numel() != layout.numel or self._flat.dtype != layout.torch_dtype:
            self._flat = torch.empty(layout.numel, dtype=layout.torch_dtype, device=self.device)
        return self._flat

    def _ship(self, layout, flat):
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.current_stream(self.device).synchronize()
        return {"layout": layout, "handle": reduce_tensor(flat)}

    def close(self) -> None:
        self._flat = None


class CudaIpcReceiver(RefitReceiver):
    name = "cuda_ipc"

    def receive(self, payload):
        rebuild, args = payload["handle"]
        flat = rebuild(*args)
        if flat.device != self.device:
            raise GymvError(f"cuda_ipc: the weights live on {flat.device}, this worker on {self.device}",
                            where="refit (cuda_ipc)", fix="cuda_ipc needs colocated workers (cluster.colocated: true)")
        return unflatten(flat, payload["layout"])


class CollectiveSender(RefitSender):
    """Broadcast from a process group of its own: rank 0 = this trainer, ranks 1..R = the receivers. Each
    bucket is broadcast asynchronously (NCCL runs it on its own stream) while the next one fills; a status
    broadcast ends every refit (1: load it, 0: the sender failed midway, load nothing). With several sending
    ranks each has a group of its own with the receivers and broadcasts its share of the buckets there; the
    receivers take the buckets in layout order, each from its sender's group."""

    name = "collective"
    backend = "gloo"
    in_band = False
    bucketed = True
    shares_sending = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._store = None
        self._pg = None
        self.staging = _DoubleBuffer()

    def rendezvous(self, weights) -> dict:
        state_dict = named(weights)
        host = _node_ip()
        self._store, self._listener = master_store(host, self.num_receivers + 1)
        layout = self._layout(state_dict)
        return {"host": host, "port": self._store.port, "world_size": self.num_receivers + 1, "backend": self.backend,
                "layout": layout, "spans": self.spans(layout), "senders": self.senders}

    def connect(self) -> None:
        self._pg = _process_group(self.backend, self._store, 0, self.num_receivers + 1)

    def _layout(self, state_dict) -> WeightLayout:
        layout = make_layout(state_dict, self.dtype)
        if self.layout is not None and layout != self.layout:
            if self._pg is not None:  # receivers already wait in the broadcasts of the old layout
                self._abort(self.spans(self.layout), 0)
            raise GymvError("the weights changed names or shapes since the receivers joined", where="refit",
                            fix="the trainer's parameters must keep their names and shapes")
        self.layout = layout
        return layout

    def _bucket_buffer(self, k, numel):
        return self.staging.get(k, numel, self.dtype, self.device)

    def _send_bucket(self, k, filled):
        self.staging.pending[k % 2] = self._pg.broadcast(filled, 0).wait

    def _finish(self, layout, spans):
        self.staging.wait_all()
        self._status(1)
        return {"layout": layout}

    def _abort(self, spans, sent):
        """Complete the broadcasts the receivers are waiting in, then tell them to load nothing."""
        try:
            self.staging.wait_all()
            for k in range(sent, len(spans)):
                if self.owns(k):
                    start, stop = spans[k]
                    self._pg.broadcast(self._bucket_buffer(k, stop - start), 0).wait()
            self._status(0)
        except Exception:  # the group itself failed: the receivers see that failure too
            pass

    def _status(self, ok: int) -> None:
        self._pg.broadcast(torch.tensor([ok], dtype=torch.int32, device=self.device), 0).wait()

    def close(self) -> None:
        self._pg = self._store = None
        self.staging = _DoubleBuffer()
        if getattr(self, "_listener", None) is not None:
            self._listener.close()
            self._listener = None


class CollectiveReceiver(RefitReceiver):
    """Receives every bucket into its own flat buffer, then loads it only if every sender's status says so.
    `info` is the sender's rendezvous, or a list of them (one per sending rank; bucket k comes from sender k
    mod their number)."""

    name = "collective"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pgs: list = []
        self._flat: torch.Tensor | None = None

    def connect(self) -> None:
        from torch.distributed import TCPStore

        infos = self.info if isinstance(self.info, list) else [self.info or {}]
        for info in infos:
            store = TCPStore(info["host"], info["port"], world_size=info["world_size"], is_master=False)
            self._pgs.append(_process_group(info["backend"], store, self.rank, info["world_size"]))

    def receive(self, payload):
        info = payload or (self.info[0] if isinstance(self.info, list) else self.info)
        layout: WeightLayout = info["layout"]
        if self._flat is None or self._flat.numel() != layout.numel or self._flat.dtype != layout.torch_dtype:
            self._flat = torch.empty(layout.numel, dtype=layout.torch_dtype, device=self.device)
        for k, (start, stop) in enumerate(info.get("spans", [(0, layout.numel)])):
            self._pgs[k % len(self._pgs)].broadcast(self._flat[start:stop], 0).wait()
        ok = True
        for pg in self._pgs:
            status = torch.zeros(1, dtype=torch.int32, device=self.device)
            pg.broadcast(status, 0).wait()
            ok = ok and int(status.item()) == 1
        if not ok:
            raise GymvError("refit: the trainer failed midway through sending the weights; none were loaded",
                            where="refit", fix="see the training worker's error")
        return unflatten(self._flat, layout)

    def close(self) -> None:
        self._pgs, self._flat = [], None


class NcclSender(CollectiveSender):
    name = "nccl"
    backend = "nccl"


class NcclReceiver(CollectiveReceiver):
    name = "nccl"


def _node_ip() -> str:
    try:
        import ray.util

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


def _process_group(backend: str, store, rank: int, world_size: int):
    import datetime

    import torch.distributed as dist

    prefixed = dist.PrefixStore("gymv-refit", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, datetime.timedelta(seconds=300))
    if backend == "nccl":
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise GymvError("this torch build has no NCCL", where="refit.transport", fix="use object_store or shm")
        return dist.ProcessGroupNCCL(prefixed, rank, world_size)
    raise GymvError(f"unknown collective backend {backend!r}", fix="use gloo or nccl")


ObjectStoreSender.receiver = ObjectStoreReceiver
ShmSender.receiver = ShmReceiver
CudaIpcSender.receiver = CudaIpcReceiver
CollectiveSender.receiver = CollectiveReceiver
NcclSender.receiver = NcclReceiver


def _sender_class(name: str) -> type[RefitSender]:
    if name not in REFIT_TRANSPORTS:
        raise GymvError(f"refit transport {name!r} has no implementation here", where="refit.transport",
                        fix=f"use one of: {', '.join(REFIT_TRANSPORTS.available())}")
    return REFIT_TRANSPORTS.load(name)


def make_sender(name: str, dtype: torch.dtype, device, num_receivers: int = 1,
                bucket_mb: float = DEFAULT_BUCKET_MB, *, rank: int = 0, senders: int = 1) -> RefitSender:
    """The sender of the transport registered as `name` (gymv.backends.registry.REFIT_TRANSPORTS);
    `bucket_mb` is the bucket size of transports that ship in buckets (0: the whole buffer at once).
    With `senders` > 1 (a transport that `shares_sending`), this is rank `rank`'s sender of its share."""
    return _sender_class(name)(dtype, device, num_receivers, bucket_mb, rank=rank, senders=senders)


def shares_sending(name: str) -> bool:
    """Whether every training rank can ship its share of a refit over transport `name`."""
    return _sender_class(name).shares_sending


def make_receiver(name: str, device, info: dict | None = None, rank: int = 1) -> RefitReceiver:
    return _sender_class(name).receiver(device, info, rank)
