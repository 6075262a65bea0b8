"""`refit.transport` against where the workers really are: auto picks by placement, and a same-host
transport across two nodes stops the launch naming both."""

from __future__ import annotations

import pytest

from gymv.backends.registry import REFIT_TRANSPORTS, TransportCapabilities
from gymv.cluster.ray_placement import Seat
from gymv.cluster.transport_choice import Layout, choose_transport
from gymv.errors import GymvError


def seat(role: str, rank: int, node: str, gpus: str = "") -> Seat:
    return Seat(role, rank, node_id=node * 8, address=f"10.0.0.{ord(node) - 96}", gpus=gpus)


TRAINER_A = [seat("training", 0, "a")]


@pytest.mark.parametrize(("layout", "gen_node", "want"), [
    (Layout(gpus=False, colocated=True), "a", "shm"),
    (Layout(gpus=False, colocated=True), "b", "object_store"),
    (Layout(gpus=False, colocated=True, lag_safe=True), "a", "object_store"),
    (Layout(gpus=True, colocated=False), "b", "nccl"),
    (Layout(gpus=True, colocated=False, workers_per_gpu=2), "a", "shm"),
    (Layout(gpus=True, colocated=True), "b", "object_store"),
])
def test_auto_picks_the_transport_the_placement_allows(layout, gen_node, want):
    assert choose_transport("auto", TRAINER_A, [seat("generation", 0, gen_node)], layout) == want


def test_auto_picks_cuda_ipc_only_where_every_receiver_shares_the_senders_gpu():
    one = [seat("training", 0, "a", "0")]
    colocated = Layout(gpus=True, colocated=True)
    assert choose_transport("auto", one, [seat("generation", 0, "a", "0")], colocated) == "cuda_ipc"
    assert choose_transport("auto", one, [seat("generation", 1, "a", "1")], colocated) == "shm"


def test_shm_across_two_nodes_is_refused_naming_both():
    with pytest.raises(GymvError, match=r"'shm' works within one host, but training rank 0 is on node 10\.0\.0\.1 "
                                        r"\(aaaaaaaa\) and generation worker 0 on node 10\.0\.0\.2 \(bbbbbbbb\)"):
        choose_transport("shm", TRAINER_A, [seat("generation", 0, "b")], Layout(gpus=False, colocated=True))


def test_an_explicit_transport_that_works_across_nodes_is_kept():
    assert choose_transport("object_store", TRAINER_A, [seat("generation", 0, "b")],
                            Layout(gpus=False, colocated=True)) == "object_store"


class PipeSender:
    """A plugin transport that declares it needs one host."""

    capabilities = TransportCapabilities(single_node_only=True)


def test_a_plugin_transport_declared_same_host_only_is_refused_across_nodes():
    REFIT_TRANSPORTS.register("named_pipe", PipeSender)
    try:
        with pytest.raises(GymvError, match="'named_pipe' works within one host"):
            choose_transport("named_pipe", TRAINER_A, [seat("generation", 0, "b")], Layout(gpus=False, colocated=True))
        assert choose_transport("named_pipe", TRAINER_A, [seat("generation", 0, "a")],
                                Layout(gpus=False, colocated=True)) == "named_pipe"
    finally:
        REFIT_TRANSPORTS.unregister("named_pipe")
