"""Bad configs fail before anything is built, naming the field and what is allowed."""

from __future__ import annotations

import pytest
import torch

import pstar_core
from pstar_core.config import ConfigError, EngineConfig
from tests.core.helpers import tiny_gpt


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"dtype": "fp8"},
            r"dtype: Input should be 'auto', 'fp32', 'bf16' or 'fp16' \(got 'fp8'\)",
        ),
        ({"chunk_size": 10}, r"chunk_size: .*>= 1024 elements, got 10"),
        ({"chunk_size": "big"}, r"chunk_size"),
        ({"optimizer": {"lr": -1}}, r"optimizer.lr: Input should be greater than 0 \(got -1\)"),
        ({"optimizer": {"betas": [0.9, 1.5]}}, r"optimizer.betas: .*each beta must be in \[0, 1\)"),
        (
            {"optimizer": {"lrr": 1e-3}},
            r"optimizer.lrr: unknown field; allowed here: betas, eps, lr",
        ),
        ({"device": "tpu"}, r"device: .*'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
        ({"gradient_clipping": 0}, r"gradient_clipping: Input should be greater than 0"),
        ({"optimizer": {"param_groups": [{"pattern": "("}]}}, r"not a valid regular expression"),
    ],
)
def test_bad_config_names_the_field_and_what_is_allowed(config, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.parse(config)


def test_config_from_yaml_file(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("dtype: fp16\noptimizer:\n  lr: 0.01\n  betas: [0.8, 0.99]\n")
    cfg = EngineConfig.parse(path)
    assert cfg.dtype == "fp16"
    assert cfg.optimizer.lr == 0.01
    assert cfg.optimizer.betas == (0.8, 0.99)


def test_missing_yaml_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        EngineConfig.parse(tmp_path / "nope.yaml")


def test_initialize_rejects_a_bad_config_before_building():
    built = []

    def model_fn():
        built.append(1)
        return tiny_gpt()

    with pytest.raises(ConfigError):
        pstar_core.initialize(model_fn, {"dtype": "int8"})
    assert not built


def test_activation_checkpointing_on_a_model_without_support_is_a_config_error():
    import torch

    with pytest.raises(ConfigError, match="gradient_checkpointing_enable"):
        pstar_core.initialize(lambda: torch.nn.Linear(4, 4), {"activation_checkpointing": True})


def test_host_budget_from_the_environment_when_the_config_gives_none(monkeypatch):
    from pstar_core.config import MemoryConfig
    from pstar_core.tiers import host_memory_limit, local_ranks, make_tiers

    cpu = torch.device("cpu")
    monkeypatch.setenv("PSTAR_HOST_BUDGET", "0.5")
    whole = host_memory_limit() // local_ranks()
    assert make_tiers(MemoryConfig(), cpu)["host"].budget_bytes == int(0.5 * whole)
    monkeypatch.setenv("PSTAR_HOST_BUDGET", str(3 << 30))
    assert make_tiers(MemoryConfig(), cpu)["host"].budget_bytes == 3 << 30
    # the job's own setting wins
    assert make_tiers(MemoryConfig(host_budget=1 << 30), cpu)["host"].budget_bytes == 1 << 30
    monkeypatch.setenv("PSTAR_HOST_BUDGET", "1.5")
    with pytest.raises(ValueError, match="PSTAR_HOST_BUDGET must be bytes"):
        make_tiers(MemoryConfig(), cpu)
