"""Hugging Face directories: stream into chunks, same logits as transformers, export back."""

from __future__ import annotations

import json

import pytest
import torch

import pstar_core
from pstar_core.hf import HFLoadError, load_causal_lm
from tests.core.helpers import MODELS, batches, engine_config, reference_model, run_engine


def save_hf(name, directory, **kwargs):
    model = reference_model(MODELS[name])
    model.save_pretrained(directory, **kwargs)
    return model


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_hf_dir_loads_into_chunks_with_the_same_logits(tmp_path, name):
    model = save_hf(name, tmp_path / "src")
    engine = pstar_core.initialize(tmp_path / "src", engine_config())
    x = batches(1)[0]
    with torch.no_grad():
        expected = model(input_ids=x).logits
        got = engine(input_ids=x).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_sharded_bf16_dir_streams_and_converts_dtype(tmp_path):
    model = reference_model(MODELS["hf_llama"]).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    assert (tmp_path / "src" / "model.safetensors.index.json").exists()
    engine = pstar_core.initialize(tmp_path / "src", engine_config("bf16"))
    sd = engine.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(sd[k].to(torch.bfloat16), v), k


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_export_after_training_loads_in_transformers_with_engine_logits(tmp_path, name):
    save_hf(name, tmp_path / "src")
    (tmp_path / "src" / "tokenizer.json").write_text("{}")  # carried over to the export
    engine = pstar_core.initialize(tmp_path / "src", engine_config())
    run_engine(engine, batches(3))
    out = engine.export_hf(tmp_path / "out", max_shard_bytes=16 * 1024)
    assert (out / "tokenizer.json").read_text() == "{}"
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    loaded = load_causal_lm(out)
    x = batches(1, seed=5)[0]
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=x).logits, engine(input_ids=x).logits, rtol=1e-5, atol=1e-6
        )
    if name == "hf_gpt2":  # tied embeddings stay tied
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_export_of_a_non_hf_model_says_what_to_use():
    engine = pstar_core.initialize(MODELS["gpt"], engine_config())
    with pytest.raises(TypeError, match="save_checkpoint or state_dict"):
        engine.export_hf("/tmp/never")


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(HFLoadError, match=r"no config\.json"):
        pstar_core.initialize(tmp_path, engine_config())


def test_corrupt_safetensors_is_a_clear_error(tmp_path):
    save_hf("hf_llama", tmp_path / "src")
    path = tmp_path / "src" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(HFLoadError, match=r"model\.safetensors is not a readable safetensors file"):
        pstar_core.initialize(tmp_path / "src", engine_config())


def test_weights_that_do_not_match_the_config_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_hf("hf_llama", tmp_path / "src")
    path = tmp_path / "src" / "model.safetensors"
    tensors = load_file(path)
    tensors["model.extra.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(
        HFLoadError, match=r"missing \['model.norm.weight'\].*unexpected \['model.extra"
    ):
        pstar_core.initialize(tmp_path / "src", engine_config())


def test_missing_weight_files_are_named(tmp_path):
    save_hf("hf_llama", tmp_path / "src")
    (tmp_path / "src" / "model.safetensors").unlink()
    with pytest.raises(HFLoadError, match=r"no model\.safetensors"):
        pstar_core.initialize(tmp_path / "src", engine_config())
