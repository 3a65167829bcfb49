"""What a training method is to the service: one object that says what its request section
holds, what data it trains on, which models it applies to, what it adds to the stored
plan, and which objective the worker loop runs (see `service.methods` for the registry
and how a method is added)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from service.data.datasets import FORMATS
from service.methods.sections import Hyperparameters, LoraSettings
from service.spec.resources import Body

if TYPE_CHECKING:
    from service.spec.run_plan import RunPlan

# what a method trains on: examples (chat, completion or text files), preference pairs, or
# prompts whose answers the model writes and a grader scores
Data = Literal["examples", "preference", "prompts"]
DATA_FORMATS: dict[Data, tuple[str, ...]] = {
    "examples": tuple(f for f in FORMATS if f not in ("preference", "prompts")),
    "preference": ("preference",),
    "prompts": ("prompts",),
}
DATA_WORDS: dict[Data, str] = {
    "examples": "chat, completion or text examples",
    "preference": "preference pairs ('input', 'preferred_output', 'non_preferred_output')",
    "prompts": "prompts ('messages' ending in a user message, the grader's item beside them)",
}


# why adapters need a pretrained model, whichever method trains them
ADAPTERS_NEED_PRETRAINED = "trains adapters on a pretrained model's frozen weights"
# the hyperparameters OpenAI's job object echoes for every method
ECHOED = ("batch_size", "learning_rate_multiplier", "n_epochs")


class Method:
    """A training method: subclass it in one module, and add the instance to
    `service.methods.BUILT_IN` (or to the `pstar.methods` entry-point group).

    Every method trains through the one worker loop (`service.worker.loop.run_loop`); what it
    changes is its objective (`service.methods.objectives`: what a step does, what an evaluation
    measures). The rest has defaults that fit a supervised method."""

    name: ClassVar[str]  # `method.type`, and the request's `method.<name>` section
    summary: ClassVar[str]  # what it does, in a few words, for messages and the document
    section: ClassVar[type[Body]]  # the request's `method.<name>`
    hyperparameters: ClassVar[type[Hyperparameters]] = Hyperparameters
    data: ClassVar[Data] = "examples"
    # why it needs a pretrained model, or None if a zoo model (random weights) will do
    pretrained: ClassVar[str | None] = None
    # where the request gives the adapter settings, when this method can train adapters
    adapter_settings_at: ClassVar[str | None] = None
    # what early stopping watches: a validation metric its objective's `evaluate` gives,
    # and the sign that makes lower better
    watched: ClassVar[tuple[str, float]] = ("valid_loss", 1.0)

    def adapters(self, section: Body | None) -> LoraSettings | None:
        """The adapters the job trains (its engine's `lora` section), or None when every
        weight trains."""
        return None

    def decided(self, hp: Hyperparameters) -> dict[str, Any]:
        """This method's own hyperparameters with "auto" decided, for the stored plan."""
        return {}

    def check(
        self,
        section: Body | None,
        first_lines: Callable[[], list[dict[str, Any]]],
        python_graders: bool,
        servable: Callable[[str, int | None, bool], None] = lambda model, tokens, grammar: None,
        embeddings: bool = False,
        unreachable: str | None = None,
    ) -> dict[str, Any]:
        """At job creation, after the files: a 400 (`InvalidRequest` naming the field) for
        what the section asks that the data or this server cannot give (`first_lines`: the
        training file's first examples, read when called; `python_graders`: whether the
        operator runs python graders; `servable(model, max_tokens, grammar)`: raises the
        API's error (its param `model` or `max_tokens`) for a question the job's workers
        could not ask this service's chat completions, `grammar` if its answer is decoded to
        a schema; `embeddings`: whether an embedding model is configured; `unreachable`:
        why a job's workers could not reach this API, None when they can); what the section
        adds to the stored plan."""
        return {}

    def objective(self, run: RunPlan) -> Any:
        """The objective the worker loop calls (`service.methods.objectives`), for a run."""
        raise NotImplementedError(f"method '{self.name}' names no objective")

    def echo(self, hp: dict[str, Any], lora: dict[str, Any] | None) -> dict[str, Any]:
        """The job object's `method.<name>`: OpenAI's hyperparameters and this method's
        own, as decided (`hp`: the stored ones), and the adapter settings where the request
        gives them (`adapter_settings_at`)."""
        own = [
            k for k in self.hyperparameters.model_fields if k not in Hyperparameters.model_fields
        ]
        section: dict[str, Any] = {
            "hyperparameters": {k: hp.get(k, "auto") for k in (*ECHOED, *own)}
        }
        if lora and self.adapter_settings_at:
            inside = self.adapter_settings_at.split(".")[2:]  # "method.<name>[.<key>]"
            if inside:
                section[inside[0]] = lora
            else:
                section.update(lora)
        return section

    def takes(self, fmt: str) -> bool:
        """Whether it trains on a file of format `fmt`."""
        return fmt in DATA_FORMATS[self.data]

    @property
    def wants(self) -> str:
        """The data it trains on, in words."""
        return DATA_WORDS[self.data]

    def __repr__(self) -> str:
        return f"<method {self.name}>"
