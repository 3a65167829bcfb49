"""Chunk layout and chunk-size search: in-order packing, aligned lists, little waste."""

from __future__ import annotations

import json

import pytest

from pstar_core.mapping import SPAN_ABOVE, make_plan, pack, search_chunk_size
from pstar_core.models import ZOO
from service.tools.planning import plan_model


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


def test_a_tensor_larger_than_the_chunk_spans_from_the_current_chunks_rest():
    layout = pack([3, 20, 2, 6], chunk_size=8)
    pieces = [(p.chunk_index, p.offset, p.numel) for p in layout.spans[1]]
    assert pieces == [(0, 3, 5), (1, 0, 8), (2, 0, 7)]
    assert [(p.chunk_index, p.offset) for p in layout.placements] == [
        (0, 0), (0, 3), (3, 0), (3, 2)
    ]  # fmt: skip
    assert list(layout.spans) == [1]
    assert layout.chunk_used == (8, 8, 7, 8)


def test_search_packs_repeated_blocks_with_little_waste():
    block = [4096, 1024, 8192, 2048]
    size = search_chunk_size([[50_000, *block * 16]])
    layout = pack([50_000, *block * 16], size)
    assert layout.utilization > 0.95
    # better than the naive choice of the largest tensor's size
    assert layout.utilization > pack([50_000, *block * 16], 50_176).utilization


def test_explicit_chunk_size_smaller_than_a_tensor_plans_it_spanning():
    plan = make_plan([5000, 10], [True, True], ["emb", "b"], "bf16", chunk_size=4096)
    assert plan.spanning == (("emb", 2),)
    assert plan.trainable.num_chunks == 2
    assert plan.utilization == 5010 / 8192


def test_a_128k_vocabulary_llama_plans_chunks_of_at_most_256m_elements(tmp_path):
    """Llama-3-8B's embedding and head (128256 x 4096 = 525M elements each) would set every
    chunk's floor; they span chunks instead, and the search picks a layer's size."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = plan_model(str(tmp_path / "config.json"), "bf16")
    assert result["chunk_size"] <= SPAN_ABOVE
    assert result["utilization"] >= 0.95
    spans = {row["tensor"]: row["chunks"] for row in result["spanning"]}
    assert spans == {"model.embed_tokens.weight": 3, "lm_head.weight": 3}


def test_the_search_keeps_the_largest_tensor_as_its_floor_up_to_the_span_limit():
    big = SPAN_ABOVE // 2
    assert search_chunk_size([[big, *[4096] * 100]]) >= big
    assert search_chunk_size([[SPAN_ABOVE + 1, *[2**20] * 2000]]) <= SPAN_ABOVE


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


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_the_list_bytes_of_a_rank_are_its_share_of_whole_groups(nproc):
    """Three trainable chunks and one frozen over `nproc` ranks: each rank owns one chunk
    of every (padded) group, so on 2 ranks it holds 2 trainable chunks, not 1.5; the sum
    is what `per_rank` gives every rank (the service's estimate divided the model's bytes
    by the workers and counted 1.5)."""
    numels = [1000, 1000, 1000, 500]
    plan = make_plan(numels, [True, True, True, False], ["a", "b", "c", "f"], "fp32", 1000, nproc)
    assert (plan.trainable.num_chunks, plan.frozen.num_chunks) == (3, 1)
    trainable = -(-3 // nproc)
    lists = plan.list_bytes(nproc)
    assert lists == {
        "param": trainable * 4000,
        "param_fp32": trainable * 4000,
        "momentum": trainable * 4000,
        "variance": trainable * 4000,
        "frozen": 4000,
    }
    assert {r["chunk_bytes"] for r in plan.per_rank(nproc)} == {sum(lists.values())}
