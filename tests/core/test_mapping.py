"""Chunk layout and chunk-size search: in-order packing, aligned lists, little waste."""

from __future__ import annotations

import pytest

from pstar_core.config import ConfigError
from pstar_core.mapping import make_plan, pack, search_chunk_size
from pstar_core.models import ZOO
from service.planning import plan_model


def test_pack_keeps_init_order_and_opens_a_chunk_when_a_tensor_does_not_fit():
    layout = pack([3, 4, 2, 5], chunk_size=8)
    assert [(p.chunk_index, p.offset) for p in layout.placements] == [
        (0, 0),
        (0, 3),
        (1, 0),
        (1, 2),
    ]
    assert layout.num_chunks == 2
    assert layout.utilization == 14 / 16


def test_pack_rejects_a_tensor_larger_than_the_chunk():
    with pytest.raises(ValueError, match="exceeds chunk size"):
        pack([10], chunk_size=8)


def test_search_packs_repeated_blocks_with_little_waste():
    block = [4096, 1024, 8192, 2048]
    size = search_chunk_size([[50_000, *block * 16]])
    layout = pack([50_000, *block * 16], size)
    assert layout.utilization > 0.95
    # better than the naive choice of the largest tensor's size
    assert layout.utilization > pack([50_000, *block * 16], 50_176).utilization


def test_explicit_chunk_size_smaller_than_a_tensor_names_it():
    with pytest.raises(ConfigError, match=r"smaller than parameter 'emb' \(5000 elements\)"):
        make_plan([5000, 10], [True, True], ["emb", "b"], "bf16", chunk_size=4096)


def test_frozen_tensors_get_their_own_list():
    plan = make_plan([2048, 2048, 2048], [True, False, True], ["a", "b", "c"], "bf16", 4096)
    assert plan.trainable.num_chunks == 1
    assert plan.frozen.num_chunks == 1
    assert plan.model_data_bytes == 4096 * 14 + 2048 * 2


@pytest.mark.parametrize("name", sorted(ZOO))
def test_auto_chunk_size_wastes_at_most_ten_percent_for_every_zoo_model(name):
    result = plan_model(name, "bf16", "auto")
    assert result["utilization"] >= 0.90
    for row in result["lists"].values():
        assert row["chunks"] == 0 or row["utilization"] >= 0.90
    assert 0 < result["model_data_bytes"] <= result["chunk_bytes"]


@pytest.mark.parametrize(("name", "dtype"), [("gpt-tiny", "bf16"), ("gpt-tiny", "fp32")])
def test_the_plan_is_what_the_engine_allocates_and_holds(name, dtype, monkeypatch):
    """`pstar plan` computes bytes from its tables; the engine's chunks are measured: the
    storage their payloads really hold, one storage counted once."""
    import pstar_core
    from pstar_core.chunk import ChunkType
    from pstar_core.models import build
    from pstar_core.tiers import TierName

    monkeypatch.delenv("PSTAR_HOST_ARENA", raising=False)  # a storage per host chunk
    result = plan_model(name, dtype, "auto")
    engine = pstar_core.initialize(lambda: build(name), {"dtype": dtype})
    residency = engine.manager.residency
    for c in residency.chunks():
        # optimizer states are made at their first use (the first Adam step): now
        residency.in_memory(c)
    st = engine.stats()
    assert st["chunk_size"] == result["chunk_size"]
    assert st["model_data_bytes"] == result["model_data_bytes"]
    storages: dict[int, int] = {}  # storage address -> bytes, over every list
    for kind, row in result["lists"].items():
        chunks = engine.manager.lists[ChunkType(kind)]
        held = {s.data_ptr(): s.nbytes() for s in (c.payload.untyped_storage() for c in chunks)}
        measured = (len(chunks), sum(held.values()))
        assert measured == (row["chunks"], row["bytes"]), kind  # the plan's tables
        assert measured == (st["chunks"][kind]["count"], st["chunks"][kind]["bytes"]), kind
        storages.update(held)
    # no two lists share memory (the fp32 params are not their own master), and the host
    # tier's account is the storage it holds
    assert sum(storages.values()) == result["chunk_bytes"]
    assert residency.tiers[TierName.HOST].used_bytes == result["chunk_bytes"]
