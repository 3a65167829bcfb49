"""Training methods as plugins: the registry, the one place a method is found by its name.

A method is one module with a `service.methods.base.Method` subclass: its request
section (`method.<name>`), the data it trains on, whether it needs a pretrained model,
what it adds to the stored plan and its objective (`service.methods.objectives`). Adding one:

1. write `service/methods/<name>.py` (see `supervised.py`, the smallest);
2. add its instance to `BUILT_IN` below.

A package outside this tree adds one without changing it, through the `pstar.methods`
entry-point group (`[project.entry-points."pstar.methods"] name = "pkg.module:INSTANCE"`),
installed wherever the service and its workers run. The request schema
(`service.spec.request.MethodRequest`), the checks at job creation, the data preparation,
the worker loop and the exports then take it; nothing else names a method.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from service.methods.base import Method
from service.methods.dpo import DPO_METHOD
from service.methods.lora import LORA
from service.methods.reinforcement import REINFORCEMENT
from service.methods.supervised import SUPERVISED

BUILT_IN: tuple[Method, ...] = (SUPERVISED, LORA, DPO_METHOD, REINFORCEMENT)
ENTRY_POINTS = "pstar.methods"
# OpenAI's methods this service does not run: parsed, so a job asking for one is told so
NOT_RUN: tuple[str, ...] = ()


def _registry() -> dict[str, Method]:
    found = {m.name: m for m in BUILT_IN}
    for ep in entry_points(group=ENTRY_POINTS):
        m = ep.load()
        if not isinstance(m, Method):
            raise TypeError(f"entry point {ep.value} ({ENTRY_POINTS}) is not a Method")
        if m.name in found or m.name in NOT_RUN:
            raise ValueError(f"entry point {ep.value} ({ENTRY_POINTS}): '{m.name}' is taken")
        found[m.name] = m
    return found


METHODS: dict[str, Method] = _registry()
DEFAULT = SUPERVISED.name  # a request without `method`


def get(name: str) -> Method:
    """The method called `name`; `KeyError` naming the ones there are."""
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(
            f"no training method '{name}'; there are {', '.join(sorted(METHODS))}"
        ) from None


def taking(fmt: str) -> list[Method]:
    """The methods that train on files of format `fmt`."""
    return [m for m in METHODS.values() if m.takes(fmt)]


__all__ = ["METHODS", "Method", "get", "taking"]
