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
    from pstar_core import tiers
    from pstar_core.config import MemoryConfig
    from pstar_core.tiers import make_tiers

    cpu = torch.device("cpu")
    monkeypatch.setattr(tiers, "host_memory_available", lambda: 40 << 30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("PSTAR_HOST_BUDGET", "0.5")
    whole = (40 << 30) - 4 * (1 << 30)  # less a margin of max(2 GiB, 10 %)
    assert make_tiers(MemoryConfig(), cpu)["host"].budget_bytes == int(0.5 * whole // 2)
    monkeypatch.setenv("PSTAR_HOST_BUDGET", str(3 << 30))
    assert make_tiers(MemoryConfig(), cpu)["host"].budget_bytes == 3 << 30
    # the job's own setting wins
    assert make_tiers(MemoryConfig(host_budget=1 << 30), cpu)["host"].budget_bytes == 1 << 30
    monkeypatch.setenv("PSTAR_HOST_BUDGET", "1.5")
    with pytest.raises(ValueError, match="PSTAR_HOST_BUDGET must be bytes"):
        make_tiers(MemoryConfig(), cpu)


def test_the_default_host_budget_is_what_the_host_can_give_less_a_margin(monkeypatch):
    """Not all of RAM: the memory available now, less max(2 GiB, 10 %), per local rank."""
    from pstar_core import tiers
    from pstar_core.config import MemoryConfig

    cpu = torch.device("cpu")
    monkeypatch.delenv("PSTAR_HOST_BUDGET", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(tiers, "host_memory_available", lambda: 100 << 30)
    assert tiers.make_tiers(MemoryConfig(), cpu)["host"].budget_bytes == 90 << 30
    monkeypatch.setattr(tiers, "host_memory_available", lambda: 8 << 30)
    assert tiers.make_tiers(MemoryConfig(), cpu)["host"].budget_bytes == 6 << 30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert tiers.make_tiers(MemoryConfig(), cpu)["host"].budget_bytes == (6 << 30) // 4
    # a machine already full: nothing, and the engine says so when the model needs some
    monkeypatch.setattr(tiers, "host_memory_available", lambda: 1 << 30)
    assert tiers.make_tiers(MemoryConfig(), cpu)["host"].budget_bytes == 0


def test_a_reservation_bounds_the_host_whole_a_budget_is_taken_from(monkeypatch):
    """Ray reserved `host_reserved` for this rank: its budgets come out of that (less the
    same margin), however much more the host has free, so co-located jobs stay in theirs."""
    from pstar_core import tiers

    monkeypatch.delenv("PSTAR_HOST_BUDGET", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")

    def host_budget(available: int, memory: dict) -> int:
        monkeypatch.setattr(tiers, "host_memory_available", lambda: available)
        engine = pstar_core.initialize(lambda: torch.nn.Linear(8, 8), {"memory": memory})
        return engine.manager.residency.tiers["host"].budget_bytes

    assert tiers.reserved_share(10 << 30) == 8 << 30  # less max(2 GiB, 10 %)
    assert tiers.reserved_share(40 << 30) == 36 << 30
    assert tiers.reserved_share(1 << 30) == 0
    reserved = {"host_reserved": 10 << 30, "host_budget": 0.5}
    assert host_budget(100 << 30, reserved) == 4 << 30  # half of 8 GiB, not of 90
    assert host_budget(8 << 30, reserved) == 3 << 30  # the host has less free: half of 6
    assert host_budget(100 << 30, {"host_reserved": 10 << 30}) == 8 << 30
    assert host_budget(100 << 30, {}) == 90 << 30  # nothing reserved: the host's share


def test_available_host_memory_counts_a_containers_limit_less_its_working_set(
    monkeypatch, tmp_path
):
    from pstar_core import tiers

    group = tmp_path / "cgroup"
    group.mkdir()
    (group / "memory.max").write_text(str(16 << 30))
    (group / "memory.current").write_text(str(10 << 30))
    (group / "memory.stat").write_text(f"anon {8 << 30}\ninactive_file {3 << 30}\n")
    real = tiers.Path

    def in_container(path, *rest):
        text = str(path)
        if text.startswith("/sys/fs/cgroup/memory."):  # cgroup v2: this container's
            return real(group, text.rsplit("/", 1)[1])
        if text.startswith("/sys/fs/cgroup/memory/"):  # cgroup v1: none here
            return real(tmp_path, "absent", text.rsplit("/", 1)[1])
        return real(path, *rest)

    monkeypatch.setattr(tiers, "Path", in_container)
    monkeypatch.setattr(tiers.psutil, "virtual_memory", lambda: _Mem(64 << 30, 50 << 30))
    # 16 GiB limit, 10 GiB used of which 3 GiB is cache the kernel can drop: 9 GiB
    assert tiers.host_memory_available() == 9 << 30


class _Mem:
    def __init__(self, total: int, available: int) -> None:
        self.total, self.available = total, available


def test_an_engine_reads_the_host_share_before_anything_of_its_own_exists(monkeypatch):
    """Ranks of one host each read what the host can give; a rank that read it after
    another had filled its share would get less than its equal part. So an engine reads
    it first, before its first collective (where the ranks meet), and never again."""
    import pstar_core
    from pstar_core import tiers
    from tests.core.helpers import MODELS, engine_config

    readings = iter([40 << 30])  # the first reading; a second one would raise

    monkeypatch.delenv("PSTAR_HOST_BUDGET", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(tiers, "host_memory_available", lambda: next(readings))
    engine = pstar_core.initialize(MODELS["gpt"], engine_config())
    assert engine.stats()["tiers"]["host"]["budget"] == ((40 << 30) - (4 << 30)) // 2
    engine.close()
