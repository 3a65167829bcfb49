"""`POST /v1/embeddings`: texts embedded by the operator's embedding model
(PSTAR_EMBEDDING_MODEL; service/serving/embeddings.py), answered as OpenAI answers,
floats or base64 (what the OpenAI SDK asks for by default). Texts are never logged."""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from api.errors import responses
from api.routes import V1_DEPENDENCIES, Ctx, Tenant, respond
from service.errors import InvalidRequest, NotServedHere
from service.serving.embeddings import MAX_INPUTS

router = APIRouter(
    tags=["embeddings"],
    responses=responses(400, 401, 404, 429, 503),
    dependencies=V1_DEPENDENCIES,
)


Text = Annotated[StrictStr, Field(min_length=1, max_length=1_000_000)]
# token ids (refused, but named in the schema as OpenAI's is, so the refusal says why)
Ids = (
    Annotated[list[StrictInt], Field(min_length=1)]
    | Annotated[list[Annotated[list[StrictInt], Field(min_length=1)]], Field(min_length=1)]
)


class EmbeddingRequest(BaseModel):
    # fields OpenAI has that change nothing here (`user`) and any others are ignored, as
    # chat completions ignore theirs
    model_config = ConfigDict(extra="ignore")

    input: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)] | Ids
    model: str = Field(max_length=256)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # ours: a text longer than the model's window is cut to it, not refused
    truncate: bool = False

    @field_validator("input", mode="before")
    @classmethod
    def _shape(cls, value: Any) -> Any:
        """What is wrong with `input`, said plainly (not each arm of the union's error)."""
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list):
            raise ValueError("give a text, or a list of texts")
        if not texts:
            raise ValueError("give at least one text")
        if len(texts) > MAX_INPUTS:
            raise ValueError(
                f"{len(texts)} texts, over the limit of {MAX_INPUTS} a request; send them in "
                "several requests"
            )
        if all(isinstance(t, str) for t in texts):
            for i, t in enumerate(texts):
                if not t:
                    where = f"input[{i}]" if isinstance(value, list) else "input"
                    raise ValueError(f"{where} is empty: give each text some characters")
        elif not (
            all(isinstance(t, int) and not isinstance(t, bool) for t in texts)
            or all(isinstance(t, list) for t in texts)
        ):
            raise ValueError("give a text, or a list of texts (strings)")
        return value


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the float32 values, little-endian


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


@router.post("/embeddings", response_model=EmbeddingList)
def embeddings(body: EmbeddingRequest, c: Ctx, tenant: Tenant) -> Response:
    """Each text's embedding, in order."""
    if c.embedder is None or body.model != c.embedder.name:
        configured = (
            f"the embedding model here is '{c.embedder.name}'"
            if c.embedder is not None
            else "no embedding model is configured on this server (an operator names one "
            "with PSTAR_EMBEDDING_MODEL)"
        )
        raise NotServedHere(f"No embedding model '{body.model}': {configured}.", param="model")
    texts = [body.input] if isinstance(body.input, str) else body.input
    if any(not isinstance(t, str) for t in texts):
        raise InvalidRequest(
            "input: token ids are not taken (they would be another tokenizer's); send the texts",
            param="input",
            code="invalid_value",
        )
    got = c.embedding_work.run(
        c.embedder.embed, texts, body.truncate, "input", body.dimensions, tenant=tenant
    )
    data = [
        Embedding(
            index=i,
            embedding=(
                v
                if body.encoding_format == "float"
                else base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
            ),
        )
        for i, v in enumerate(got.vectors)
    ]
    usage = EmbeddingUsage(prompt_tokens=got.tokens, total_tokens=got.tokens)
    return respond(EmbeddingList(data=data, model=c.embedder.name, usage=usage))
