"""Weight refit transports and the encoder-cache reset rule, without Ray (the end-to-end runs use Ray)."""

from __future__ import annotations

import os
import threading
import weakref

import pytest
import torch

from gymv.cluster.refit import make_layout, make_receiver, make_sender, unflatten, weights_hash
from gymv.errors import GymvError
from net_listeners import listeners
from train_helpers import no_shared_ray


@pytest.fixture(scope="module", autouse=True)
def without_ray():
    """Outside Ray the object store's buckets are plain copies in the payload, which these tests read: a
    Ray that an earlier module of this process left running is stopped first."""
    no_shared_ray()


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(6, 4, generator=g)
    return {"embed.weight": shared, "layer.weight": torch.randn(3, 5, generator=g), "layer.bias": torch.randn(3, generator=g),
            "head.weight": shared}  # tied to embed.weight


def test_layout_stores_a_tied_tensor_once_and_restores_both_names():
    sd = _state()
    layout = make_layout(sd)
    assert layout.numel == 6 * 4 + 3 * 5 + 3
    assert dict(layout.aliases) == {"head.weight": "embed.weight"}


@pytest.mark.parametrize("transport", ["object_store", "shm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transport_delivers_every_weight_in_the_generation_dtype(transport, dtype):
    sd = _state()
    sender = make_sender(transport, dtype, "cpu")
    receiver = make_receiver(transport, "cpu")
    try:
        got = receiver.receive(sender.publish(sd))
        assert set(got) == set(sd)
        assert all(got[k].dtype == dtype and torch.equal(got[k], sd[k].to(dtype)) for k in sd)
        assert weights_hash(got) == weights_hash(sd, dtype)
        sd2 = _state(seed=1)  # the next step reuses the transport (shm rewrites its segment in place)
        got2 = receiver.receive(sender.publish(sd2))
        assert weights_hash(got2) == weights_hash(sd2, dtype) != weights_hash(sd, dtype)
    finally:
        receiver.close()
        sender.close()


def test_a_sender_takes_weights_streamed_as_name_tensor_pairs_like_a_state_dict():
    sd = _state()
    sender, receiver = make_sender("object_store", torch.float32, "cpu"), make_receiver("object_store", "cpu")
    got = receiver.receive(sender.publish((name, t) for name, t in sd.items()))  # a trainer's named_weights()
    assert weights_hash(got) == weights_hash(sd) and dict(sender.layout.aliases) == {"head.weight": "embed.weight"}


def _gathered(sd, alive: list):
    """(name, tensor) pairs as a sharded trainer yields them: each a fresh tensor (a gather); before making
    the next one, count how many earlier ones are still alive."""
    refs = []
    for name, t in sd.items():
        alive.append(sum(r() is not None for r in refs))
        fresh = t.clone()
        refs.append(weakref.ref(fresh))
        yield name, fresh
        del fresh


@pytest.mark.parametrize("transport", ["object_store", "shm"])
def test_after_the_first_refit_gathered_weights_are_copied_in_one_at_a_time(transport):
    sender, receiver = make_sender(transport, torch.bfloat16, "cpu"), make_receiver(transport, "cpu")
    try:
        receiver.receive(sender.publish(_state()))  # the first refit makes the layout
        alive: list[int] = []
        sd = {k: v for k, v in _state(seed=1).items() if k != "head.weight"}  # a gather yields a tied name once
        got = receiver.receive(sender.publish(_gathered(sd, alive)))
        assert max(alive) == 0  # no earlier gathered tensor outlives its copy into the buffer
        assert weights_hash(got) == weights_hash(_state(seed=1), torch.bfloat16)
    finally:
        receiver.close()
        sender.close()


def test_a_streamed_refit_whose_weights_changed_shape_is_refused():
    sender = make_sender("object_store", torch.float32, "cpu")
    sender.publish(_state())
    changed = dict(_state(), **{"layer.bias": torch.zeros(4)})
    with pytest.raises(GymvError, match="layer.bias"):
        sender.publish(iter(changed.items()))


def test_a_streamed_refit_missing_a_weight_is_refused():
    sender = make_sender("object_store", torch.float32, "cpu")
    sender.publish(_state())
    with pytest.raises(GymvError, match="never arrived"):
        sender.publish(iter([(k, v) for k, v in _state().items() if k != "layer.weight"]))


def _bucket_mb(numel: int, dtype=torch.float32) -> float:
    """A bucket of `numel` elements of `dtype`, as refit.bucket_mb."""
    return numel * torch.empty((), dtype=dtype).element_size() / 2**20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_buckets_smaller_than_the_largest_tensor_deliver_every_weight_exactly(dtype):
    """7-element buckets: embed.weight (24 elements) spans four of them; both refits (the first from a
    mapping, the next streamed) arrive bit for bit."""
    sender = make_sender("object_store", dtype, "cpu", bucket_mb=_bucket_mb(7, dtype))
    receiver = make_receiver("object_store", "cpu")
    first = sender.publish(_state())
    assert len(first["buckets"]) == 6 and all(len(b) <= 7 for b in first["buckets"])  # 42 elements
    got = receiver.receive(first)
    assert all(torch.equal(got[k], v.to(dtype)) for k, v in _state().items())
    streamed = {k: v for k, v in _state(seed=1).items() if k != "head.weight"}
    got = receiver.receive(sender.publish(iter(streamed.items())))
    assert weights_hash(got) == weights_hash(_state(seed=1), dtype)
    assert got["head.weight"] is got["embed.weight"]


def test_a_bucketed_refit_holds_two_buckets_and_one_gathered_tensor():
    sender = make_sender("object_store", torch.float32, "cpu", bucket_mb=_bucket_mb(5))
    receiver = make_receiver("object_store", "cpu")
    receiver.receive(sender.publish(_state()))
    alive: list[int] = []
    sd = {k: v for k, v in _state(seed=1).items() if k != "head.weight"}
    got = receiver.receive(sender.publish(_gathered(sd, alive)))
    assert max(alive) == 0  # no earlier gathered tensor outlives its copy into a bucket
    assert sender.staging.numel == 2 * 5  # the trainer's staging: two buckets, not the 42-element model
    assert weights_hash(got) == weights_hash(_state(seed=1))


def test_a_bucket_size_of_zero_ships_the_whole_buffer_at_once():
    sender = make_sender("object_store", torch.float32, "cpu", bucket_mb=0)
    payload = sender.publish(_state())
    assert payload["spans"] == [(0, 42)] and len(payload["buckets"]) == 1
    assert weights_hash(make_receiver("object_store", "cpu").receive(payload)) == weights_hash(_state())


def test_a_streamed_refit_that_sends_a_weight_twice_is_refused():
    sender = make_sender("object_store", torch.float32, "cpu", bucket_mb=_bucket_mb(5))
    sd = _state()
    sender.publish(sd)
    with pytest.raises(GymvError, match="'embed.weight' arrived again"):
        sender.publish(iter([("embed.weight", sd["embed.weight"]), ("layer.weight", sd["layer.weight"]),
                             ("embed.weight", sd["embed.weight"])]))


def _collective(num_receivers: int, bucket_mb: float, sd):
    """A collective sender and receivers (threads of this process, as separate workers would be)."""
    sender = make_sender("collective", torch.float32, "cpu", num_receivers=num_receivers, bucket_mb=bucket_mb)
    info = sender.rendezvous(sd)
    receivers = [make_receiver("collective", "cpu", info, rank) for rank in range(1, num_receivers + 1)]
    threads = [threading.Thread(target=r.connect) for r in receivers]
    for t in threads:
        t.start()
    sender.connect()
    for t in threads:
        t.join(timeout=60)
    return sender, receivers


def _receive_all(receivers) -> tuple[dict, list]:
    """Each receiver's weights hash (or its error), received in threads beside the sender's publish."""
    results: dict = {}
    errors: list = []

    def receive(r):
        try:
            results[r.rank] = weights_hash(r.receive(None))
        except GymvError as e:
            errors.append(e)

    threads = [threading.Thread(target=receive, args=(r,)) for r in receivers]
    for t in threads:
        t.start()
    return results, errors, threads


def test_collective_buckets_smaller_than_a_tensor_reach_every_receiver_exactly():
    sender, receivers = _collective(2, _bucket_mb(7), _state())
    assert len(sender.spans(sender.layout)) == 6
    for seed in (0, 1):  # the first refit, then a streamed one
        results, errors, threads = _receive_all(receivers)
        sd = _state(seed)
        sender.publish(sd if seed == 0 else iter([(k, v) for k, v in sd.items() if k != "head.weight"]))
        for t in threads:
            t.join(timeout=60)
        assert errors == [] and results == {1: weights_hash(sd), 2: weights_hash(sd)}
    assert sender.staging.numel == 2 * 7


def test_a_collective_refit_that_fails_midway_loads_nothing_and_the_next_one_works():
    """The sender fails after shipping two buckets: receivers get the abort flag instead of hanging in the
    broadcast, and the group stays in step for the next refit."""
    sender, receivers = _collective(1, _bucket_mb(7), _state())
    results, errors, threads = _receive_all(receivers)
    bad = list(_state(seed=1).items())
    bad[2] = ("layer.bias", torch.zeros(4))  # after embed.weight (24) and layer.weight (15): 5 buckets went out
    with pytest.raises(GymvError, match="layer.bias"):
        sender.publish(iter(bad))
    for t in threads:
        t.join(timeout=60)
    assert results == {} and len(errors) == 1 and "failed midway" in str(errors[0])
    results, errors, threads = _receive_all(receivers)
    sender.publish(_state(seed=2))
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and results == {1: weights_hash(_state(seed=2))}
    results, errors, threads = _receive_all(receivers)
    with pytest.raises(GymvError, match="changed names or shapes"):  # refused before any bucket: still aborted
        sender.publish(dict(_state(), **{"layer.bias": torch.zeros(4)}))
    for t in threads:
        t.join(timeout=60)
    assert results == {} and len(errors) == 1 and "failed midway" in str(errors[0])


def test_collective_transport_broadcasts_over_its_own_process_group():
    """The code path behind `nccl`, run on gloo: rank 0 sends, two receivers get the weights."""
    sd = _state()
    sender = make_sender("collective", torch.float32, "cpu", num_receivers=2)
    info = sender.rendezvous(sd)
    receivers = [make_receiver("collective", "cpu", info, rank) for rank in (1, 2)]
    results: dict = {}

    def receive(r):
        r.connect()
        results[r.rank] = weights_hash(r.receive(None))

    threads = [threading.Thread(target=receive, args=(r,)) for r in receivers]
    for t in threads:
        t.start()
    sender.connect()
    sender.publish(sd)
    for t in threads:
        t.join(timeout=60)
    assert results == {1: weights_hash(sd), 2: weights_hash(sd)}
    wildcard = [(addr, port) for _, addr, port in listeners({os.getpid()}) if addr in ("0.0.0.0", "::")]
    assert wildcard == []  # the store listens on the node's address only (127.0.0.1 in a local cluster)


def test_unknown_transport_is_a_config_error():
    with pytest.raises(GymvError, match="no implementation"):
        make_sender("carrier-pigeon", torch.float32, "cpu")


def test_views_share_the_flat_buffer():
    sd = _state()
    layout = make_layout(sd)
    flat = torch.zeros(layout.numel)
    views = unflatten(flat, layout)
    flat.fill_(1.0)
    assert all(bool((v == 1).all()) for v in views.values())


# -- the encoder-cache reset happens only when configured and only after a refit that succeeded ------------


def _generation_worker(reset: bool):
    from gymv.cluster.workers import GenerationWorker, WorkerSpec
    from gymv.config.schema import EnvSection, GenerationSection
    from tiny_models import tiny_path

    return GenerationWorker(WorkerSpec(model_path=str(tiny_path("tiny-llava")), env=EnvSection(name="circle-count"),
                                       generation=GenerationSection(reset_encoder_cache_after_weight_update=reset),
                                       threads=1))


@pytest.fixture(scope="module")
def workers():
    return {True: _generation_worker(True), False: _generation_worker(False)}


def _payload(worker, scale=1.0, bad=False):
    sd = {k: v * scale for k, v in worker.backend.model.state_dict().items()}
    if bad:  # the last tensor is wrong: nothing before it may be loaded either
        name = list(sd)[-1]
        sd[name] = torch.zeros(*sd[name].shape, 2)
    return make_sender("object_store", torch.float32, "cpu").publish(sd)


def test_cache_is_reset_after_each_successful_refit_when_enabled(workers):
    w = workers[True]
    before = w.stats()["encoder_cache_resets"]
    w.receive(_payload(w), version=1)
    w.receive(_payload(w), version=2)
    assert w.stats()["encoder_cache_resets"] == before + 2
    assert w.stats()["weights_version"] == 2


def test_cache_is_kept_when_the_reset_is_off(workers):
    w = workers[False]
    w.receive(_payload(w), version=1)
    assert w.stats()["encoder_cache_resets"] == 0 and w.stats()["weight_updates"] == 1


def test_a_failed_refit_changes_nothing_and_does_not_reset_the_cache(workers):
    w = workers[True]
    before, weights = w.stats(), w.weights_hash()
    with pytest.raises(GymvError, match="shape"):
        w.receive(_payload(w, scale=2.0, bad=True), version=9)
    after = w.stats()
    assert after["encoder_cache_resets"] == before["encoder_cache_resets"]
    assert after["weights_version"] == before["weights_version"] and w.weights_hash() == weights


def test_a_bucketed_refit_whose_last_bucket_is_wrong_loads_none_of_the_earlier_ones(workers):
    w = workers[True]
    before, weights = w.stats(), w.weights_hash()
    sd = {k: v * 2.0 for k, v in w.backend.model.state_dict().items()}
    payload = make_sender("object_store", torch.float32, "cpu", bucket_mb=0.25).publish(sd)
    assert len(payload["buckets"]) > 2
    payload["buckets"][-1] = payload["buckets"][-1][:-1]
    with pytest.raises(GymvError, match="none were loaded"):
        w.receive(payload, version=9)
    assert w.weights_hash() == weights and w.stats()["weights_version"] == before["weights_version"]
    assert w.stats()["encoder_cache_resets"] == before["encoder_cache_resets"]


def test_generation_worker_hash_matches_the_weights_it_received(workers):
    w = workers[False]
    sd = {k: v + 0.5 for k, v in w.backend.model.state_dict().items()}
    w.receive(make_sender("object_store", torch.float32, "cpu").publish(sd), version=3)
    assert w.weights_hash() == weights_hash(sd)
