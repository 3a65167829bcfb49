"""api/tinker_wire: Tinker's protobuf messages read and written as the `tinker` SDK itself
writes and reads them (its own request encoder and result decoders, 0.38.0)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from api.tinker_wire import (
    Sampled,
    forward_backward_result,
    read_forward_backward,
    sample_result,
)
from service.sessions.losses import BadInput, Output, Unsupported


def sdk_body(data, loss_fn="ppo", config=None, seq_id=3) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=config
        ),
        model_id="sess-1:train:0",
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_a_forward_backward_request_reads_as_the_sdk_wrote_it():
    first = types.Datum(
        model_input=types.ModelInput(
            chunks=[types.EncodedTextChunk(tokens=[5, 6]), types.EncodedTextChunk(tokens=[7])]
        ),
        loss_fn_inputs={
            "target_tokens": [6, 7, 8],
            "logprobs": [-0.5, -1.25, -2.0],
            "advantages": np.array([1.0, -1.0, 0.5], dtype=np.float32),
        },
    )
    second = types.Datum(
        model_input=types.ModelInput.from_ints([9, 10]),
        loss_fn_inputs={
            "target_tokens": torch.tensor([10, 11]),
            "logprobs": [-0.1, -0.2],
            "advantages": [0.0, 2.0],
        },
    )
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    call = read_forward_backward(sdk_body([first, second], config=config, seq_id=7))
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == (
        "sess-1:train:0",
        7,
        "ppo",
        False,
    )
    assert call.config == pytest.approx(config)
    assert [d.tokens for d in call.data] == [[5, 6, 7], [9, 10]]
    assert call.data[0].inputs["target_tokens"] == [6, 7, 8]
    assert call.data[0].inputs["logprobs"] == [-0.5, -1.25, -2.0]
    assert call.data[1].inputs["advantages"] == [0.0, 2.0]


def test_an_image_chunk_and_a_garbled_body_are_refused_with_what_was_wrong():
    image = types.Datum(
        model_input=types.ModelInput(
            chunks=[
                types.ImageChunk(data=b"\x89PNG", format="png"),
                types.EncodedTextChunk(tokens=[1]),
            ]
        ),
        loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]},
    )
    with pytest.raises(Unsupported, match=r"data\[0\]: a image chunk .* text tokens only"):
        read_forward_backward(sdk_body([image], loss_fn="cross_entropy"))
    with pytest.raises(BadInput, match="not a ForwardBackwardRequest"):
        read_forward_backward(b"\xff\xff\xff\xff garbage")


def test_the_forward_backward_result_reads_in_the_sdk_as_per_datum_logprobs():
    out = Output([[-0.5, -1.5, -2.25], [-3.0]], {"loss:sum": 7.25})
    got = deserialize_forward_backward_output(forward_backward_result(out))
    assert got.metrics == {"loss:sum": 7.25}
    assert [d["logprobs"].tolist() for d in got.loss_fn_outputs] == out.logprobs
    assert [d["logprobs"].dtype for d in got.loss_fn_outputs] == ["float32", "float32"]
    with pytest.raises(ValueError, match="name:reduction"):
        forward_backward_result(Output([[0.0]], {"loss": 1.0}))


def test_the_sample_result_reads_in_the_sdk_with_tokens_logprobs_and_stop_reasons():
    seqs = [Sampled([4, 5, 6], [-0.25, -0.5, -1.0], "length"), Sampled([7], [-2.0], "stop")]
    got = deserialize_sample_response(sample_result(seqs, prompt_logprobs=[math.nan, -1.5]))
    assert [s.tokens for s in got.sequences] == [[4, 5, 6], [7]]
    assert [s.logprobs for s in got.sequences] == [[-0.25, -0.5, -1.0], [-2.0]]
    assert [s.stop_reason for s in got.sequences] == ["length", "stop"]
    assert got.prompt_logprobs == [None, -1.5]


def test_a_loss_input_with_more_than_one_value_per_position_is_refused():
    two_d = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=[1, 2, 3, 4], dtype="int64", shape=[2, 2]),
            "weights": [1.0, 1.0],
        },
    )
    with pytest.raises(Unsupported, match=r"has shape \[2, 2\]; the built-in losses"):
        read_forward_backward(sdk_body([two_d], loss_fn="cross_entropy"))
