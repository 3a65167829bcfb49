"""Tinker's binary messages: the `forward_backward` request we read, and the
`forward_backward` and sample results we answer with (docs/sessions.md: from tinker 0.25
on, these three are protobuf; every other message is JSON).

The schema is the SDK's own (`tinker.proto.tinker_public_pb2`), so what we read and write
is what the SDK writes and reads. Tokens travel as int32 little-endian bytes; a datum's
loss inputs as tensors (dense, or sparse CSR rows), float32 or int64; results as one
record whose per-datum tensors are concatenated with byte offsets. Image and audio
chunks are refused by name, as the engine trains on text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from service.sessions.losses import BadInput, Datum, Output, Unsupported

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, Any]
    forward_only: bool
    data: list[Datum]


def read_forward_backward(body: bytes) -> ForwardBackwardCall:
    """A `forward_backward` request body (or `forward`'s: `forward_only`)."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError, or a truncated message
        raise BadInput(f"the forward_backward body is not a ForwardBackwardRequest: {e}") from e
    # the SDK writes numbers to both maps and strings to v2 only; v2 wins where set
    config: dict[str, Any] = dict(msg.loss_fn_config)
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else v.number
    data = [_datum(k, d) for k, d in enumerate(msg.data)]
    return ForwardBackwardCall(
        msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data
    )


def _datum(k: int, d: Any) -> Datum:
    tokens: list[int] = []
    for chunk in d.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise Unsupported(
                f"data[{k}]: a {kind} chunk in model_input; this engine trains on text "
                "tokens only (encoded_text chunks)"
            )
        tokens += np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist()
    inputs = {name: _tensor(k, name, t) for name, t in d.loss_fn_inputs.items()}
    return Datum(tokens, inputs)


def _tensor(k: int, name: str, t: Any) -> list[float]:
    """A datum's loss input as a flat list (one value per position)."""
    dtype = _NUMPY.get(t.dtype)
    if dtype is None:
        raise BadInput(f"data[{k}].loss_fn_inputs[{name!r}]: unknown dtype {t.dtype}")
    shape = list(t.shape)
    if t.WhichOneof("encoding") == "sparse_csr":
        csr = t.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        rows = np.frombuffer(csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(shape) != 2 or len(rows) != shape[0] + 1:
            raise BadInput(f"data[{k}].loss_fn_inputs[{name!r}]: a sparse tensor of shape {shape}")
        arr = np.zeros(shape, dtype=dtype)
        for r in range(shape[0]):
            a, b = int(rows[r]), int(rows[r + 1])
            arr[r, cols[a:b]] = values[a:b]
    else:
        arr = np.frombuffer(t.dense, dtype=dtype)
        if shape and int(np.prod(shape)) != arr.size:
            raise BadInput(
                f"data[{k}].loss_fn_inputs[{name!r}]: {arr.size} values for shape {shape}"
            )
    if any(s != 1 for s in shape[1:]):
        raise Unsupported(
            f"data[{k}].loss_fn_inputs[{name!r}] has shape {shape}; the built-in losses "
            "take one value per position"
        )
    return arr.reshape(-1).tolist()


def forward_backward_result(out: Output) -> bytes:
    """The result the SDK reads as a `ForwardBackwardOutput`: per datum, the target
    tokens' `logprobs` (float32), and the metrics (`name:reduction` keys)."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = msg.loss_fn_outputs.add(num_datums=len(out.logprobs))
    record.fields["logprobs"].CopyFrom(_batched([np.asarray(lp, "<f4") for lp in out.logprobs]))
    for key, value in out.metrics.items():
        if key.count(":") != 1:
            raise ValueError(f"metric {key!r}: Tinker's metrics are named 'name:reduction'")
        msg.metrics[key] = float(value)
    return msg.SerializeToString()


def _batched(arrays: Sequence[np.ndarray]) -> Any:
    offsets = np.zeros(len(arrays) + 1, dtype="<i8")
    np.cumsum([a.nbytes for a in arrays], out=offsets[1:])
    data = b"".join(a.tobytes() for a in arrays)
    return pb.BatchedTensor(data=data, offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32)


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" (a stop sequence or EOS) or "length" (max_tokens)


def sample_result(sequences: Sequence[Sampled], prompt_logprobs: list[float] | None = None):
    """The result the SDK reads as a `SampleResponse`: each sequence's tokens, their
    log-probabilities and why it stopped; the prompt's log-probabilities when asked
    (the first is NaN: nothing predicts it)."""
    msg = pb.SampleResponse()
    for s in sequences:
        msg.sequences.add(
            stop_reason=STOP_REASONS[s.stop_reason],
            tokens=np.asarray(s.tokens, "<i4").tobytes(),
            logprobs=np.asarray(s.logprobs, "<f4").tobytes(),
        )
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, "<f4").tobytes()
    return msg.SerializeToString()
