"""A reinforcement job's model graders (score_model, label_model, and the `cosine` metric's
embeddings) and its model-server sampler as clients of this service's own API: the one
module below `api` that speaks HTTP (scripts/structure.py names it). A job's workers ask
the models its graders name through `/v1/chat/completions`, embed through
`/v1/embeddings`, and sample their answers through the job's rollouts route, as the
job's tenant, so they are answered as `/fine_tuning/alpha/graders/run`'s are
(service.control.grader_access makes the key and says where the API is).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from service.methods.graders import Ask, Embed


class GraderModelError(RuntimeError):
    """A model grader's model could not answer (a reinforcement job fails, saying
    why)."""


BUSY = (429, 502, 503, 504)  # asked again: the tenant's generations are all in use, or
# the model server is starting or restarting


def _client(base_url: str, key: str, timeout_s: float, transport: Any) -> httpx.Client:
    # the key goes to `base_url` only (no proxy from the environment)
    return httpx.Client(
        base_url=base_url,
        headers={"Authorization": f"Bearer {key}"},
        timeout=timeout_s,
        transport=transport,
        trust_env=False,
    )


def _post(
    client: httpx.Client, path: str, body: dict[str, Any], patience_s: float, who: str
) -> Any:
    """The JSON of a 200 to `body` at `path`, asked again while the server is busy (429,
    502-504, or none answering) after a wait of up to 5 s, for `patience_s`; else
    GraderModelError saying that `who` did not answer, and why."""
    why = ""
    give_up, wait = time.monotonic() + patience_s, 0.25
    while True:
        try:
            r = client.post(path, json=body)
        except httpx.HTTPError as e:
            why = f"the API at {client.base_url} did not answer: {type(e).__name__}: {e}"
        else:
            if r.status_code == 200:
                return r.json()
            why = f"{r.status_code}: {_error_message(r)}"
            if r.status_code not in BUSY:
                break
        if time.monotonic() + wait > give_up:
            break
        time.sleep(wait)
        wait = min(5.0, wait * 2)
    raise GraderModelError(f"{who} did not answer ({why})")


def api_asker(
    base_url: str,
    key: str,
    timeout_s: float = 300.0,
    patience_s: float = 600.0,
    transport: httpx.BaseTransport | None = None,
) -> Ask:
    """`Ask` through `base_url`'s `/v1/chat/completions` with `key` (a job's grader key:
    service.control.grader_access), so a job's graders are answered as `/graders/run`'s
    are: any model its tenant may call, with the service's limits (its questions take the
    tenant's share of generations as its own calls do). A busy server is asked again
    (`_post`); any other answer but a 200 fails at once."""
    client = _client(base_url, key, timeout_s, transport)

    def ask(model: str, messages: list[dict[str, str]], sampling: dict[str, Any]):
        body = {"model": model, "messages": messages, "n": 1}
        body.update({k: v for k, v in sampling.items() if v is not None})
        who = f"a model grader's model {model}"
        out = _post(client, "/v1/chat/completions", body, patience_s, who)
        text = out["choices"][0]["message"].get("content") or ""
        return text, int(out["usage"]["total_tokens"])

    return ask


def api_embedder(
    base_url: str,
    key: str,
    model: str,
    timeout_s: float = 300.0,
    patience_s: float = 600.0,
    transport: httpx.BaseTransport | None = None,
) -> Embed:
    """`Embed` through `base_url`'s `/v1/embeddings` (the embedding model `model`) with
    `key`, as `api_asker` asks; texts longer than the model's window are cut to it
    (`truncate`), as the `cosine` grader embeds them."""
    client = _client(base_url, key, timeout_s, transport)

    def embed(texts: list[str]) -> list[list[float]]:
        body = {"model": model, "input": texts, "encoding_format": "float", "truncate": True}
        out = _post(client, "/v1/embeddings", body, patience_s, f"the embedding model {model}")
        return [d["embedding"] for d in sorted(out["data"], key=lambda d: d["index"])]

    return embed


def api_rollouts(
    base_url: str,
    key: str,
    path: str,
    timeout_s: float = 3600.0,
    patience_s: float = 600.0,
    transport: httpx.BaseTransport | None = None,
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A reinforcement job's answers from the model server: `body` posted to `path` (its
    rollouts route: service.methods.rollouts) with the job's key, as `api_asker` asks (a
    server still starting its model is waited for); the reply's JSON. `timeout_s` is the
    longest a step's sampling may take."""
    client = _client(base_url, key, timeout_s, transport)

    def post(body: dict[str, Any]) -> dict[str, Any]:
        return _post(client, path, body, patience_s, "the model server sampling the answers")

    return post


def _error_message(r: Any) -> str:
    try:
        return str(r.json()["error"]["message"])[:300]
    except Exception:
        return r.text[:300]
