"""A reinforcement job's model graders (score_model, label_model) as clients of this
service's own API: the one module below `api` that speaks HTTP (scripts/structure.py
names it). A job's workers
ask the models its graders name through `/v1/chat/completions`, as the job's tenant, so
they are answered as `/fine_tuning/alpha/graders/run`'s are (service.control.grader_access
makes the key and says where the API is).
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from service.methods.graders import Ask


class GraderModelError(RuntimeError):
    """A model grader's model could not answer (a reinforcement job fails, saying
    why)."""


BUSY = (429, 502, 503, 504)  # asked again: the tenant's generations are all in use, or
# the model server is starting or restarting


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
    tenant's share of generations as its own calls do). A busy server (429, 502-504, or
    none answering) is asked again after a wait of up to 5 s, for `patience_s`; any other
    answer but a 200 fails at once. The key goes to `base_url` only (no proxy from the
    environment)."""
    client = httpx.Client(
        base_url=base_url,
        headers={"Authorization": f"Bearer {key}"},
        timeout=timeout_s,
        transport=transport,
        trust_env=False,
    )

    def ask(model: str, messages: list[dict[str, str]], sampling: dict[str, Any]):
        body = {"model": model, "messages": messages, "n": 1}
        body.update({k: v for k, v in sampling.items() if v is not None})
        why = ""
        give_up, wait = time.monotonic() + patience_s, 0.25
        while True:
            try:
                r = client.post("/v1/chat/completions", json=body)
            except httpx.HTTPError as e:
                why = f"the API at {base_url} did not answer: {type(e).__name__}: {e}"
            else:
                if r.status_code == 200:
                    out = r.json()
                    text = out["choices"][0]["message"].get("content") or ""
                    return text, int(out["usage"]["total_tokens"])
                why = f"{r.status_code}: {_error_message(r)}"
                if r.status_code not in BUSY:
                    break
            if time.monotonic() + wait > give_up:
                break
            time.sleep(wait)
            wait = min(5.0, wait * 2)
        raise GraderModelError(f"a model grader's model {model} did not answer ({why})")

    return ask


def _error_message(r: Any) -> str:
    try:
        return str(r.json()["error"]["message"])[:300]
    except Exception:
        return r.text[:300]
