"""The dry run's resources check: workers placed on the Ray cluster's nodes as asked."""

from __future__ import annotations

import pytest

from service.control.estimate import place_workers


def res(workers: int, cpus: float = 1.0, gpu: bool = False) -> dict:
    return {"num_workers": workers, "cpus_per_worker": cpus, "use_gpu": gpu}


def test_workers_fit_when_each_node_has_room_for_its_share():
    nodes = [{"CPU": 4.0}, {"CPU": 2.0}]
    out = place_workers(res(3, cpus=2.0), nodes)
    assert out["fits"] is True
    assert out["placeable_workers"] == 3  # 2 on the first node, 1 on the second
    assert out["cluster"] == {"nodes": 2, "CPU": 6.0, "GPU": 0, "memory": 0}


def test_cpus_split_over_nodes_do_not_make_a_worker():
    # 5 CPUs in all, but no node has 3 free for a second worker
    out = place_workers(res(2, cpus=3.0), [{"CPU": 3.0}, {"CPU": 2.0}])
    assert out["fits"] is False
    assert out["placeable_workers"] == 1
    assert "2 workers x 3 CPU" in out["problem"]
    assert "queued" in out["problem"]


def test_gpu_workers_need_a_gpu_each():
    nodes = [{"CPU": 16.0, "GPU": 1.0}, {"CPU": 16.0}]
    assert place_workers(res(1, gpu=True), nodes)["fits"] is True
    out = place_workers(res(2, gpu=True), nodes)
    assert out["fits"] is False
    assert "+ 1 GPU" in out["problem"]


def test_a_worker_needs_its_reserved_memory_on_one_node():
    gib = 1 << 30
    nodes = [{"CPU": 8.0, "memory": 10.0 * gib}, {"CPU": 8.0, "memory": 5.0 * gib}]
    asked = {**res(4), "memory_per_worker": 4 * gib}
    out = place_workers(asked, nodes)
    # CPUs would take 16; memory 2 on the first node and 1 on the second
    assert (out["placeable_workers"], out["fits"]) == (3, False)
    assert "+ 4.0 GiB" in out["problem"]
    assert place_workers({**asked, "num_workers": 3}, nodes)["fits"] is True


@pytest.mark.parametrize("nodes", [None, []])
def test_an_unknown_cluster_is_not_called_too_small(nodes):
    out = place_workers(res(64), nodes)
    assert out["fits"] is None
    assert "problem" not in out


@pytest.mark.parametrize(
    ("strategy", "placeable", "fits"),
    [("PACK", 6, True), ("STRICT_SPREAD", 2, False), ("STRICT_PACK", 4, True)],
)
def test_the_placement_strategy_decides_how_many_workers_a_cluster_places(
    strategy, placeable, fits
):
    nodes = [{"CPU": 4.0}, {"CPU": 2.0}]
    out = place_workers({**res(3), "placement_strategy": strategy}, nodes)
    assert (out["placeable_workers"], out["fits"]) == (placeable, fits)
    if not fits:
        assert f"can be placed {strategy}" in out["problem"]
