"""The trainer a job's driver runs starts no actor that our runs never use."""

from __future__ import annotations

from ray.train import ScalingConfig

from service.worker.trainer import lean_torch_trainer


def _callback_names(trainer) -> set[str]:
    return {type(cb).__name__ for cb in trainer._create_default_callbacks()}


def test_lean_trainer_drops_the_dataset_manager_and_keeps_the_placement_group_cleaner():
    names = _callback_names(lean_torch_trainer(lambda _c: None, scaling_config=ScalingConfig()))
    assert "DatasetsCallback" not in names
    # it frees a killed driver's workers' resources for the next attempt at once
    assert "PlacementGroupCleanerCallback" in names
    # what the workers do need stays: the process group and the device set-up
    assert {"BackendSetupCallback", "AcceleratorSetupCallback"} <= names


def test_lean_trainer_keeps_ray_datasets_when_it_is_given_some():
    import ray.data

    trainer = lean_torch_trainer(
        lambda _c: None,
        scaling_config=ScalingConfig(),
        datasets={"train": ray.data.from_items([{"x": 1}])},
    )
    assert "DatasetsCallback" in _callback_names(trainer)
