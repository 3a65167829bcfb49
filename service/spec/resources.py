"""What a job asks of the cluster (`Resources`), and the rules every request body follows
(`Body`, `WHOLE`).

Its own module so that both the job request (`service.control.jobs`) and the settings (whose
PSTAR_DEFAULT_RESOURCES is checked as a job's `resources`) import it without importing
each other.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _whole_float_to_int(v: Any) -> Any:
    # JSON Schema's "integer" (what the API's document says) takes 2.0; a strict int would
    # refuse it, and a lax one would also take "2" and true, which we refuse
    return int(v) if isinstance(v, float) and v.is_integer() else v


# last in `Annotated[int, Field(strict=True, ...), WHOLE]`, so it runs first and the
# limits stay in the document as minimum/maximum
WHOLE = BeforeValidator(_whole_float_to_int)


class Body(BaseModel):
    """A part of a request body: unknown fields and non-finite numbers are refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Resources(Body):
    num_workers: Annotated[int, Field(strict=True, ge=1, le=256), WHOLE] = Field(
        default=1, description="Ray Train workers; the chunks are sharded over them (ZeRO)"
    )
    use_gpu: Annotated[bool, Field(strict=True)] = Field(
        default=False, description="one GPU per worker, NCCL between them"
    )
    cpus_per_worker: Annotated[float, Field(gt=0, le=512)] = 1.0
    memory_per_worker: Annotated[int | None, Field(strict=True, ge=3 << 30), WHOLE] = Field(
        default=None,
        description="bytes of host memory Ray reserves for each worker (at least 3 GiB); "
        "the worker's host tier plans within it, less max(2 GiB, 10%) for the process "
        "itself, so the jobs a node runs together never ask it for more than it has. "
        "Without it nothing is reserved and a worker plans with its share of what its "
        "node has free when it starts",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        default="PACK",
        description="how Ray places the workers on nodes: PACK (as few nodes as may be), "
        "SPREAD (as many), STRICT_PACK (one node), STRICT_SPREAD (one worker per node; the "
        "job waits for as many nodes as workers)",
    )
