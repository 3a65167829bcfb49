"""Supervised fine-tuning (OpenAI's `supervised`): every weight trains on next-token
cross-entropy over the labelled tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from service.methods.base import Method
from service.methods.sections import Hyperparameters
from service.spec.resources import Body

if TYPE_CHECKING:
    from service.spec.run_plan import RunPlan


class SupervisedSection(Body):
    hyperparameters: Hyperparameters | None = None


class SupervisedMethod(Method):
    name = "supervised"
    summary = "every weight trains"
    section: ClassVar[type[Body]] = SupervisedSection

    def objective(self, run: RunPlan) -> Any:
        from service.methods.objectives import Supervised

        return Supervised()


SUPERVISED = SupervisedMethod()
