"""OpenAI's graders, as its reinforcement fine-tuning and `/fine_tuning/alpha/graders` take
them: a grader scores a model's answer (`sample`) to a dataset line (`item`) in [0, 1]
(or the range a formula gives), the reward of one sample in the reinforcement loop.

A grader is parsed once (`parse_grader`: a 400 that names the field for anything OpenAI
would refuse, or that this service does not run), then run many times (`grade`). Its
text fields are templates: `{{item.answer}}`, `{{item.meta.lang}}`,
`{{sample.output_text}}`, `{{sample.output_json.city}}`.

What each grader computes, and with which library:
- `string_check`: `eq` and `ne` compare the two strings exactly; `like` scores 1 when
  the input contains the reference, `ilike` the same ignoring case.
- `text_similarity`, by `evaluation_metric`:
  - `fuzzy_match`: RapidFuzz's `fuzz.ratio` / 100 (normalized Indel similarity);
  - `bleu`: NLTK's `sentence_bleu` (4-grams, uniform weights, smoothing method 1, so a
    short answer missing some 4-gram does not score 0 outright);
  - `gleu`: NLTK's `sentence_gleu` (Google-BLEU, 1- to 4-grams);
  - `meteor`: NLTK's `meteor_score`, with the WordNet 3.0 this machine has (Debian's
    wordnet-base) for synonym matches (NLTK looks them up by a word's Porter stem);
  - `rouge_1` ... `rouge_5`, `rouge_l`: the F-measure of Google's `rouge-score`
    (its tokenizer: lower case, alphanumeric tokens), the package most papers cite;
  - `cosine`: the cosine of the angle between the two texts' embeddings, by the model
    the operator configured (PSTAR_EMBEDDING_MODEL, run by sentence-transformers:
    service/serving/embeddings.py), asked through this service's `/v1/embeddings`; a 400
    where none is configured. Texts longer than its window are cut to it; an empty text
    scores 1 against an empty one, else 0.
  BLEU, GLEU and METEOR split text into words and punctuation marks (a regex; NLTK's
  own tokenizer needs data files downloaded from the internet).
- `multi`: named graders, and `calculate_output`, a formula over their scores
  (`+ - * / ^`, parentheses, `min max abs floor ceil exp sqrt log`), evaluated by
  `simpleeval` (an AST walker with no access to Python's builtins), never by `eval`.
- `python`: the caller's `grade(sample, item)`, when the operator turned python graders on
  (PSTAR_PYTHON_GRADERS=on), in a sandboxed process (service/methods/python_grader.py);
  otherwise a 400 saying so.
- `score_model`: a model this service serves (a base, a fine-tuned model, a checkpoint)
  answers the grader's messages through the same path as `/v1/chat/completions`; the
  first number in its answer is the score, kept within `range` (default [0, 1]). An
  answer with no number scores the range's low end (OpenAI's `model_grader_parse_error`).
- `label_model`: the same, asked with a JSON schema (`{"label": one of labels}`), so the
  judge's answer is decoded to one of the `labels` (constrained decoding, as OpenAI asks
  for a model that supports structured outputs); it scores 1 when that label is one of
  `passing_labels`, else 0. A judge whose tokenizer cannot be constrained (not a fast
  tokenizer) is refused by the model server: `/graders/run` is a 400, a job fails at its
  first graded batch naming the model. An answer that is still no label scores 0 with
  `model_grader_parse_error`.
"""

from __future__ import annotations

import ast
import operator
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
)

from service.errors import InvalidRequest, describe_invalid
from service.methods.formula import evaluate, formula
from service.methods.python_grader import PythonScore, SandboxLimits, run_python
from service.methods.similarity import cosine, similarity, wordnet_dir
from service.methods.templates import (
    NOT_JSON,
    TEMPLATE,
    SampleNotJson,
    json_or_none,
    lookup,
    render,
)
from service.spec.resources import WHOLE

SIMILARITY_METRICS = (
    "fuzzy_match", "bleu", "gleu", "meteor", "cosine",
    "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l",
)  # fmt: skip
MODEL_GRADERS = ("score_model", "label_model")  # graders that ask a served model
EMBEDDED = "cosine"  # the similarity metric that asks the embedding model
PYTHON_OFF = (
    "python graders run the caller's code, and they are off on this server (an operator "
    "turns them on with PSTAR_PYTHON_GRADERS=on); express the check as string_check, "
    "text_similarity or multi"
)


class _Grader(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=256)


class StringCheck(_Grader):
    type: Literal["string_check"]
    input: str
    reference: str
    operation: Literal["eq", "ne", "like", "ilike"]


class TextSimilarity(_Grader):
    type: Literal["text_similarity"]
    input: str
    reference: str
    evaluation_metric: Literal[SIMILARITY_METRICS]  # type: ignore[valid-type]
    # OpenAI's evals take it; graders ignore it, as here (a score, not a pass/fail)
    pass_threshold: Annotated[float, Field(strict=True)] | None = None


def _kind(value: Any) -> str:
    """A grader's union tag, "type[string_check]": a form the API's error messages leave out
    of a field's path (service/errors.py `_LOC_TAG`), so a wrong operation is reported at
    `grader.operation`, not `grader.string_check.operation`."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"type[{kind}]"


_KIND = Discriminator(
    _kind,
    custom_error_type="grader_type",
    custom_error_message="Input should be a grader: 'type' one of string_check, "
    "text_similarity, python, score_model, label_model, multi",
)


class Python(_Grader):
    type: Literal["python"]
    source: str = Field(min_length=1, max_length=256_000)
    image_tag: str | None = None  # OpenAI's runtime image; one runtime here: ignored


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["input_text", "output_text"]
    text: str


class ModelMessage(BaseModel):
    """One of a model grader's messages; text only (no model here sees images)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["user", "assistant", "system", "developer"]
    content: str | TextPart | list[str | TextPart]
    type: Literal["message"] | None = None

    def text(self) -> str:
        parts = self.content if isinstance(self.content, list) else [self.content]
        return "".join(p if isinstance(p, str) else p.text for p in parts)


class ModelSampling(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_completions_tokens: Annotated[int, Field(strict=True, ge=1), WHOLE] | None = None
    temperature: Annotated[float, Field(strict=True, ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(strict=True, gt=0, le=1)] | None = None
    seed: Annotated[int, Field(strict=True), WHOLE] | None = None
    reasoning_effort: str | None = None  # for reasoning models; none is served here


Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class ScoreModel(_Grader):
    type: Literal["score_model"]
    model: str = Field(min_length=1)
    input: list[ModelMessage] = Field(min_length=1)
    range: tuple[Finite, Finite] = (0.0, 1.0)
    sampling_params: ModelSampling | None = None

    @field_validator("range")
    @classmethod
    def _low_then_high(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not v[0] < v[1]:
            raise ValueError(f"must be [low, high] with low < high, got {list(v)}")
        return v


class LabelModel(_Grader):
    type: Literal["label_model"]
    model: str = Field(min_length=1)
    input: list[ModelMessage] = Field(min_length=1)
    labels: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1, max_length=256)
    passing_labels: list[str] = Field(min_length=1)

    @field_validator("labels")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) < len(v):
            raise ValueError(f"labels must differ, got {v}")
        return v

    @field_validator("passing_labels")
    @classmethod
    def _among_labels(cls, v: list[str], info: Any) -> list[str]:
        labels = info.data.get("labels")
        if labels is not None and (strays := [x for x in v if x not in labels]):
            raise ValueError(f"{strays} are not among labels {labels}")
        return v

    def answer_schema(self) -> dict[str, Any]:
        """The answer's JSON schema: one label."""
        return {
            "type": "object",
            "properties": {"label": {"type": "string", "enum": self.labels}},
            "required": ["label"],
            "additionalProperties": False,
        }


Leaf = Annotated[
    Annotated[StringCheck, Tag("type[string_check]")]
    | Annotated[TextSimilarity, Tag("type[text_similarity]")]
    | Annotated[Python, Tag("type[python]")]
    | Annotated[ScoreModel, Tag("type[score_model]")]
    | Annotated[LabelModel, Tag("type[label_model]")],
    _KIND,
]


class Multi(_Grader):
    type: Literal["multi"]
    graders: dict[str, Leaf]
    calculate_output: str = Field(min_length=1, max_length=2000)


Grader = Annotated[
    Annotated[StringCheck, Tag("type[string_check]")]
    | Annotated[TextSimilarity, Tag("type[text_similarity]")]
    | Annotated[Python, Tag("type[python]")]
    | Annotated[ScoreModel, Tag("type[score_model]")]
    | Annotated[LabelModel, Tag("type[label_model]")]
    | Annotated[Multi, Tag("type[multi]")],
    _KIND,
]
_GRADER: TypeAdapter[Any] = TypeAdapter(Grader)


# -- parsing -----------------------------------------------------------------------------


def parse_grader(
    raw: Any, param: str = "grader", *, python: bool = False, embeddings: bool = False
) -> Any:
    """The grader `raw` (a JSON object as OpenAI takes it), or a 400 naming the field;
    `python`: whether python graders are on (Settings.python_graders); `embeddings`:
    whether an embedding model is configured (Settings.embedding_model), which `cosine`
    needs."""
    raw = prepared(raw, param)
    try:
        grader = _GRADER.validate_python(raw)
    except ValidationError as e:
        loc, msg, others = describe_invalid(e.errors())
        where = ".".join([param, *loc])
        more = f" (and {others} more)" if others else ""
        raise InvalidRequest(f"{where}: {msg}{more}", param=where) from None
    return checked(grader, param, python=python, embeddings=embeddings)


def prepared(raw: Any, param: str = "grader") -> Any:
    """`raw` before its schema is checked: images or audio in a model grader's messages
    and a multi grader inside a multi grader are 400s that say why (not a schema's "no
    such type"), and a multi grader's single grader (as the SDK's types show it) is named
    by its own name."""
    if not isinstance(raw, dict):
        return raw  # the schema's own error
    _refuse_unrun_parts(raw, param)
    if raw.get("type") == "multi":
        raw = {**raw, "graders": _named_graders(raw.get("graders"), f"{param}.graders")}
    return raw


def checked(
    grader: Any, param: str = "grader", *, python: bool = False, embeddings: bool = False
) -> Any:
    """`grader` once its schema holds, or a 400 for what no schema says: a metric this
    server cannot compute, a variable graders do not have, a formula that is not one,
    python graders while they are off or source with no `grade` function."""
    for name, leaf in leaves(grader):
        where = f"{param}.graders.{name}" if name else param
        _check_metric(leaf, where, embeddings)
        if isinstance(leaf, Python):
            _check_python(leaf, where, python)
    for where, text in _templates(grader, param):
        for ref in TEMPLATE.findall(text):
            _check_reference(ref, where)
    if isinstance(grader, Multi):
        formula(grader.calculate_output, set(grader.graders), f"{param}.calculate_output")
    return grader


def _refuse_unrun_parts(raw: dict, param: str) -> None:
    kind = raw.get("type")
    if kind in MODEL_GRADERS and isinstance(raw.get("input"), list):
        _refuse_media(raw["input"], f"{param}.input")
    if kind == "multi" and isinstance(raw.get("graders"), dict):
        inner = raw["graders"]
        single = "type" in inner and isinstance(inner.get("type"), str)
        for name, sub in ({"": inner} if single else inner).items():
            where = f"{param}.graders{'.' + name if name else ''}"
            if isinstance(sub, dict) and isinstance(sub.get("input"), list):
                _refuse_media(sub["input"], f"{where}.input")
            if isinstance(sub, dict) and sub.get("type") == "multi":
                raise InvalidRequest(
                    f"{param}.graders.{name}: a multi grader's graders cannot be multi",
                    param=f"{param}.graders.{name}.type",
                )


def _refuse_media(messages: list, param: str) -> None:
    """Images and audio in a model grader's messages: a 400 that says why."""
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        parts = content if isinstance(content, list) else [content]
        for j, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind not in ("input_text", "output_text"):
                where = f"{param}.{i}.content" + (f".{j}" if isinstance(content, list) else "")
                raise InvalidRequest(
                    f"{where}.type: {kind!r}: model graders take text only here (no "
                    "model this service serves reads images or audio)",
                    param=f"{where}.type",
                )


def _named_graders(raw: Any, param: str) -> Any:
    """OpenAI's API takes `graders` as {name: grader}; its SDK's types show one grader:
    that one is named by its own `name`."""
    if isinstance(raw, dict) and isinstance(raw.get("type"), str):
        return {str(raw.get("name") or "grader"): raw}
    if not isinstance(raw, dict) or not raw:
        raise InvalidRequest(f"{param} must be an object of named graders", param=param)
    return raw


def _check_python(leaf: Python, where: str, on: bool) -> None:
    if not on:
        raise InvalidRequest(f"{where}: {PYTHON_OFF}", param=f"{where}.type")
    try:
        tree = ast.parse(leaf.source)
    except (MemoryError, RecursionError):
        raise InvalidRequest(
            f"{where}.source: nested too deeply to compile", param=f"{where}.source"
        ) from None
    except SyntaxError as e:
        raise InvalidRequest(
            f"{where}.source: not Python (line {e.lineno}: {e.msg})", param=f"{where}.source"
        ) from None
    if not any(isinstance(n, ast.FunctionDef) and n.name == "grade" for n in tree.body):
        raise InvalidRequest(
            f"{where}.source: defines no function grade(sample, item) returning a score",
            param=f"{where}.source",
        )


def leaves(grader: Any) -> list[tuple[str, Any]]:
    """(name, grader) of each grader that scores: a multi grader's by name, or the one."""
    if isinstance(grader, Multi):
        return list(grader.graders.items())
    return [("", grader)]


def _templates(grader: Any, param: str) -> list[tuple[str, str]]:
    out = []
    for name, leaf in leaves(grader):
        where = f"{param}.graders.{name}" if name else param
        if isinstance(leaf, ScoreModel | LabelModel):
            out += [(f"{where}.input.{i}", m.text()) for i, m in enumerate(leaf.input)]
        elif not isinstance(leaf, Python):  # python graders read `item` themselves
            out += [(f"{where}.input", leaf.input), (f"{where}.reference", leaf.reference)]
    return out


def _check_metric(leaf: Any, where: str, embeddings: bool) -> None:
    if isinstance(leaf, TextSimilarity):
        if leaf.evaluation_metric == EMBEDDED and not embeddings:
            raise InvalidRequest(
                f"{where}.evaluation_metric: cosine needs an embedding model, and none is "
                "configured on this server (an operator names one with "
                "PSTAR_EMBEDDING_MODEL); choose fuzzy_match, bleu, gleu, meteor or a rouge",
                param=f"{where}.evaluation_metric",
            )
        if leaf.evaluation_metric == "meteor" and wordnet_dir() is None:
            raise InvalidRequest(
                f"{where}.evaluation_metric: meteor needs WordNet 3.0, which this server "
                "lacks (Debian's wordnet-base package, or WNSEARCHDIR); choose another metric",
                param=f"{where}.evaluation_metric",
            )


def _check_reference(ref: str, where: str) -> None:
    parts = ref.split(".")
    ok = (parts[0] == "item" and len(parts) > 1) or (
        parts[0] == "sample"
        and len(parts) > 1
        and (parts[1:] == ["output_text"] or parts[1] == "output_json")
    )
    if not ok or not all(parts):
        raise InvalidRequest(
            f"{where}: {{{{{ref}}}}} is not a variable graders have; use {{{{item.<key>}}}}, "
            "{{sample.output_text}} or {{sample.output_json.<key>}}",
            param=where,
        )


def check_item(grader: Any, item: Any, param: str) -> None:
    """A 400 if a template names a key of `item` that it does not have (a training line)."""
    for where, text in _templates(grader, "grader"):
        for ref in TEMPLATE.findall(text):
            if ref.startswith("item."):
                try:
                    lookup(item, ref.split(".")[1:])
                except KeyError:
                    raise InvalidRequest(
                        f"{param}: {where} uses {{{{{ref}}}}}, and the line has no such key",
                        param=param,
                    ) from None


# -- grading -----------------------------------------------------------------------------


# a model grader's question: (model, [{"role", "content"}], sampling) -> (answer,
# tokens used); the caller answers it the way its chat completions do
Ask = Callable[[str, list[dict[str, str]], dict[str, Any]], tuple[str, int]]
# the cosine metric's question: texts -> their embeddings, in order (longer ones cut to the
# model's window), as `/v1/embeddings` answers
Embed = Callable[[list[str]], list[list[float]]]


@dataclass(frozen=True)
class Runners:
    """What grading needs beyond the grader: the python sandbox's limits, how to ask a
    served model and how to embed texts (None: model graders, or `cosine`, cannot be run
    here)."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    ask: Ask | None = None
    embed: Embed | None = None


@dataclass
class Graded:
    """A sample's reward, with each named grader's score for a multi grader, and what
    went wrong on the way (OpenAI's error flags)."""

    reward: float
    sub_rewards: dict[str, float] = field(default_factory=dict)
    sample_parse_error: bool = False
    python_errors: list[str] = field(default_factory=list)  # why a python grader scored 0
    python_server_error: bool = False  # the sandbox failed (not the grader's code)
    formula_error: bool = False  # calculate_output had no value (e.g. a division by 0)
    model_parse_error: bool = (
        False  # a score_model's answer held no number, a label_model's no label
    )
    model_tokens: dict[str, int] = field(default_factory=dict)  # model -> tokens used
    seconds: float = 0.0

    @property
    def python_error(self) -> str | None:
        return "; ".join(self.python_errors) or None


def grade(
    grader: Any,
    sample: str,
    item: Any,
    runners: Runners | None = None,
    python: dict[int, PythonScore] | None = None,
) -> Graded:
    """Score `sample` against `item`. Deterministic but for model graders sampled
    without a seed: the same inputs, the same reward. A template naming an item key that
    is missing raises InvalidRequest; one asking for the sample's JSON when it is not JSON
    scores 0 (OpenAI's `sample_parse_error`). `python`: each python grader's score of this
    sample, by the grader's id, when `grade_all` ran them already."""
    t0 = time.perf_counter()
    ns = {"item": item, "sample": {"output_text": sample, "output_json": json_or_none(sample)}}
    out = Graded(0.0)
    run = runners or Runners()
    ready = python or {}
    try:
        if isinstance(grader, Multi):
            out.sub_rewards = {n: _score(g, ns, run, out, ready) for n, g in grader.graders.items()}
            value = evaluate(grader.calculate_output, out.sub_rewards)
            out.reward, out.formula_error = (0.0, True) if value is None else (value, False)
        else:
            out.reward = _score(grader, ns, run, out, ready)
    except SampleNotJson:
        out.reward, out.sub_rewards, out.sample_parse_error = 0.0, {}, True
    out.seconds = time.perf_counter() - t0
    return out


ASKED_AT_ONCE = 4  # a batch's model graders' questions in flight at once (a tenant's default
# share of generations: PSTAR_MAX_CONCURRENT_GENERATIONS_PER_TENANT)


def grade_all(
    grader: Any, samples: list[str], items: list[Any], runners: Runners | None = None
) -> list[Graded]:
    """`grade` of each (sample, item), with each python grader run once for them all: one
    sandboxed process a batch, not one an answer, which cost a reinforcement step one
    interpreter start per sampled answer. The batch's CPU and wall limits are one answer's
    times the answers (up to `BATCH_LIMITS_TIMES`); a batch that broke them, or whose
    process failed, is graded again one answer at a time, so one answer cannot zero the
    others. The rewards are those of grading one by one, but for a grader that keeps state
    between calls (module globals live for the batch)."""
    run = runners or Runners()
    scored: dict[int, list[PythonScore]] = {}
    for _, leaf in leaves(grader):
        if isinstance(leaf, Python) and samples:
            pairs = [(_python_sample(s), it) for s, it in zip(samples, items, strict=True)]
            scored[id(leaf)] = _python_batch(leaf.source, pairs, run.limits)

    def one(n: int) -> Graded:
        return grade(grader, samples[n], items[n], run, {k: v[n] for k, v in scored.items()})

    if not any(_asks(leaf) for _, leaf in leaves(grader)):
        return [one(n) for n in range(len(samples))]
    # model graders' questions wait on a model: several in flight, batched by its server; a
    # question that fails stops the batch (those not started are dropped)
    pool = ThreadPoolExecutor(max_workers=ASKED_AT_ONCE)
    try:
        return list(pool.map(one, range(len(samples))))
    finally:
        pool.shutdown(cancel_futures=True)


def _asks(leaf: Any) -> bool:
    """Whether grading with `leaf` waits on a model (a served one, or the embedder)."""
    return isinstance(leaf, ScoreModel | LabelModel) or (
        isinstance(leaf, TextSimilarity) and leaf.evaluation_metric == EMBEDDED
    )


BATCH_LIMITS_TIMES = 64  # a python batch's CPU and wall limits: at most this many answers'


def _python_batch(source: str, pairs: list, limits: SandboxLimits) -> list[PythonScore]:
    times = min(len(pairs), BATCH_LIMITS_TIMES)
    batch = replace(limits, cpu_s=limits.cpu_s * times, wall_s=limits.wall_s * times)
    got = run_python(source, pairs, batch)
    broke = len(pairs) > 1 and len({g.error for g in got}) == 1 and got[0].error is not None
    if not broke:
        return got
    # every answer failed alike: a limit or the process, most likely; one answer at a time
    return [run_python(source, [pair], limits)[0] for pair in pairs]


def _python_sample(text: str) -> dict[str, Any]:
    """The `sample` a python grader's `grade(sample, item)` gets (`output_json` None for
    an answer that is not JSON)."""
    parsed = json_or_none(text)
    return {"output_text": text, "output_json": None if parsed is NOT_JSON else parsed}


def _score(leaf: Any, ns: dict, run: Runners, out: Graded, ready: dict[int, PythonScore]) -> float:
    if isinstance(leaf, Python):
        got = ready.get(id(leaf))
        if got is None:
            sample = _python_sample(ns["sample"]["output_text"])
            (got,) = run_python(leaf.source, [(sample, ns["item"])], run.limits)
        if got.error:
            out.python_errors.append(got.error)
            out.python_server_error |= got.kind == "server"
        return got.score
    if isinstance(leaf, ScoreModel):
        return _ask_model(leaf, ns, run, out)
    if isinstance(leaf, LabelModel):
        return _ask_label(leaf, ns, run, out)
    text, ref = render(leaf.input, ns), render(leaf.reference, ns)
    if isinstance(leaf, StringCheck):
        return float(_STRING_OPS[leaf.operation](text, ref))
    if leaf.evaluation_metric == EMBEDDED:
        return _embedded_cosine(text, ref, run)
    return similarity(leaf.evaluation_metric, text, ref)


def _embedded_cosine(text: str, ref: str, run: Runners) -> float:
    if not text.strip() or not ref.strip():  # nothing to embed on one side
        return float(text.strip() == ref.strip())
    if run.embed is None:
        raise RuntimeError(
            "a cosine metric needs an embedding model, and this server has none configured "
            "now (PSTAR_EMBEDDING_MODEL was unset after the job was created)"
        )
    a, b = run.embed([text, ref])
    return cosine(a, b)


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _asked(leaf: ScoreModel | LabelModel, ns: dict, run: Runners, out: Graded, **more: Any) -> str:
    """A model grader's answer to its rendered messages (`more`: sampling settings)."""
    if run.ask is None:
        raise InvalidRequest(f"{leaf.type} graders cannot be run here", param="grader.type")
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": render(m.text(), ns)}
        for m in leaf.input
    ]
    answer, tokens = run.ask(leaf.model, messages, more)
    out.model_tokens[leaf.model] = out.model_tokens.get(leaf.model, 0) + tokens
    return answer


def _ask_label(leaf: LabelModel, ns: dict, run: Runners, out: Graded) -> float:
    schema = {"name": "label", "strict": True, "schema": leaf.answer_schema()}
    answer = _asked(
        leaf,
        ns,
        run,
        out,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": schema},
    )
    label = json_or_none(answer)
    if not isinstance(label, dict) or label.get("label") not in leaf.labels:
        out.model_parse_error = True
        return 0.0
    return float(label["label"] in leaf.passing_labels)


def _ask_model(leaf: ScoreModel, ns: dict, run: Runners, out: Graded) -> float:
    sp = leaf.sampling_params or ModelSampling()
    answer = _asked(
        leaf, ns, run, out,
        max_tokens=sp.max_completions_tokens, temperature=sp.temperature, top_p=sp.top_p,
        seed=sp.seed,
    )  # fmt: skip
    low, high = leaf.range
    found = _NUMBER.search(answer)
    if found is None:
        out.model_parse_error = True
        return low
    return min(high, max(low, float(found.group())))


_STRING_OPS = {
    "eq": operator.eq,
    "ne": operator.ne,
    "like": lambda a, b: b in a,
    "ilike": lambda a, b: b.casefold() in a.casefold(),
}
