"""The text fields of OpenAI's graders are templates: `{{item.answer}}`,
`{{item.meta.lang}}`, `{{sample.output_text}}`, `{{sample.output_json.city}}`; how they
are rendered against a dataset line and a model's answer (service/methods/graders.py)."""

from __future__ import annotations

import json
import re
from typing import Any

from service.errors import InvalidRequest

MAX_RENDERED_CHARS = 1 << 20  # what one template may render to
TEMPLATE = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")


class SampleNotJson(Exception):
    """A template asks for `sample.output_json` (or a key of it) that the answer lacks."""


def render(template: str, ns: dict) -> str:
    """`template` with each {{name.path}} replaced by its value (JSON for objects)."""

    size = 0

    def one(m: re.Match) -> str:
        nonlocal size
        parts = m.group(1).split(".")
        in_json = parts[:2] == ["sample", "output_json"]
        if in_json and ns["sample"]["output_json"] is NOT_JSON:
            raise SampleNotJson
        try:
            value = lookup(ns, parts)
        except KeyError:
            if in_json:  # the answer's JSON lacks the key: the answer's fault, scored 0
                raise SampleNotJson from None
            raise InvalidRequest(
                f"{{{{{m.group(1)}}}}} names a key the item does not have", param="item"
            ) from None
        text = value if isinstance(value, str) else json.dumps(value)
        size += len(text)
        if size > MAX_RENDERED_CHARS:
            raise InvalidRequest(
                f"a grader's template renders to more than {MAX_RENDERED_CHARS:,} characters; "
                "name smaller values, or fewer of them",
                param="grader",
            )
        return text

    return TEMPLATE.sub(one, template)


def lookup(value: Any, path: list[str]) -> Any:
    for key in path:
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif (
            isinstance(value, list)
            and key.isascii()
            and key.isdigit()
            and len(key) < 10
            and int(key) < len(value)
        ):
            value = value[int(key)]
        else:
            raise KeyError(key)
    return value


NOT_JSON = object()  # `sample.output_json` of an answer that is not JSON (null is JSON)


def json_or_none(text: str) -> Any:
    """The answer read as JSON, or NOT_JSON; JSON nested too deeply to be written back
    (the python sandbox's input, a template's value) counts as not JSON."""
    try:
        value = json.loads(text)
        json.dumps(value)
        return value
    except (ValueError, RecursionError):
        return NOT_JSON
