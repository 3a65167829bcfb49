"""Data preparation for a job's plan: the tokenizer, the encoded rows, the step count.

Used by the dry run (`validate`) and by the Ray job driver, so both decide the same
`seq_len` and the same number of steps. A HF base model brings its own tokenizer (and
chat template); a zoo model gets a byte-level BPE tokenizer trained on the training file,
with ChatML's turn markers as single tokens.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service import methods
from service.data.datasets import (
    CHATML_TEMPLATE,
    DataError,
    Encoded,
    check_examples,
    content_text,
    iter_examples,
    prompt_item,
)
from service.data.packing import padding_share, rows
from service.data.preference import pair_rows
from service.data.rows import fresh, prompt_rows, publish, text_rows
from service.data.tokens import Tokens, tokenize
from service.spec import auto
from service.spec.job import JobSpec

ZOO_VOCAB = 4096
ZOO_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass
class Prepared:
    tokenizer: Any
    train: Encoded
    valid: Encoded | None
    seq_len: int
    format: str
    steps_per_epoch: int
    total_steps: int
    # asked ("auto", True, False), decided, and the padding share one example per row has
    packing: dict[str, Any] = field(default_factory=dict)
    # a bounded sample's size against the file's (`prepare(sample=...)`); None: the whole file
    sampled: dict[str, int] | None = None

    def report(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "seq_len": self.seq_len,
            "packing": self.packing,
            "training_file": self.train.report(),
            "validation_file": self.valid.report() if self.valid is not None else None,
            "steps_per_epoch": self.steps_per_epoch,
            "total_steps": self.total_steps,
            **({"sampled": self.sampled} if self.sampled is not None else {}),
        }


def load_tokenizer(model: dict[str, Any], fmt: str, examples: Iterable[Any], cache: Path | None):
    """The model's tokenizer (HF dirs), or one trained on the examples (zoo models; read
    as they stream by)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if model["kind"] != "zoo":
        return AutoTokenizer.from_pretrained(model["path"])
    if cache is not None and (cache / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(cache))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=ZOO_VOCAB,
        special_tokens=ZOO_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_texts(fmt, examples), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML_TEMPLATE
    if cache is not None:
        fast.save_pretrained(str(cache))
    return fast


def _texts(fmt: str, examples: Iterable[Any]):
    for ex in examples:
        if fmt == "chat":
            yield from (m["content"] or "" for m in ex["messages"])
            # a zoo model's tokenizer sees the calls and tools too, as JSON
            yield from (json.dumps(m["tool_calls"]) for m in ex["messages"] if "tool_calls" in m)
            if "tools" in ex:
                yield json.dumps(ex["tools"])
        elif fmt == "completion":
            yield ex["prompt"]
            yield ex["completion"]
        elif fmt == "prompts":
            yield from (content_text(m["content"]) for m in ex["messages"] if m.get("content"))
        elif fmt == "preference":
            yield from (m["content"] or "" for m in ex["input"]["messages"])
            yield ex["preferred_output"][0]["content"]
            yield ex["non_preferred_output"][0]["content"]
        else:
            yield ex["text"]


def max_positions(model: dict[str, Any]) -> int:
    if model["kind"] == "zoo":
        return 1 << 15  # the zoo model is built with the chosen seq_len

    cfg = json.loads((Path(model["path"]) / "config.json").read_text())
    return int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or 2048)


def prepare(
    spec: JobSpec,
    train_path: Path,
    valid_path: Path | None,
    tokenizer_cache: Path | None = None,
    sample: int | None = None,
    out: Path | None = None,
) -> Prepared:
    """Tokenize the files as the spec says, deciding `seq_len` and `packing` where it
    leaves them "auto"; raises `DataError` for unusable data.

    The files stream: each line is parsed and tokenized as it is read, the tokens go to
    flat int32 buffers (`service.data.tokens`), and the rows are made in pieces
    (`service.data.rows`), into `.npy` files under `out` when it is given (a job's
    preparation: memory holds a few bytes per example, the tokens wait on disk beside
    `out`) or into memory.

    With `sample`, only the first `sample` examples of each file are read (the dry run's
    bounded look, in the API process): what is decided and counted is the sample's, and the
    step count is scaled to the whole training file's examples (`sampled` says by how much).
    The job itself prepares the whole files (`service.control.driver`)."""
    fmt = check_examples(train_path, limit=sample)
    method = spec.training_method
    if not method.takes(fmt):
        raise DataError(_method_format_mismatch("training file", fmt, method))
    vfmt = check_examples(valid_path, limit=sample) if valid_path is not None else None
    if vfmt is not None and not method.takes(vfmt):
        raise DataError(_method_format_mismatch("validation file", vfmt, method))
    model = spec.model.model_dump()
    tok = load_tokenizer(model, fmt, iter_examples(train_path, sample), tokenizer_cache)
    hp = spec.hyperparameters
    work = None
    if out is not None:  # the tokens wait beside the rows (a lost attempt's are cleared)
        out.mkdir(parents=True, exist_ok=True)
        work = out.with_name(out.name + ".tokens")
        shutil.rmtree(work, ignore_errors=True)
    try:
        tokens = tokenize(tok, fmt, iter_examples(train_path, sample), _under(work, "train"))
        seq_len = hp.seq_len
        limit = max_positions(model)
        # a reinforcement prompt's row holds its answer too, sampled after it
        own = hp.model_extra or {}
        room = int(own.get("max_completion_tokens", 0)) if fmt == "prompts" else 0
        grader = _grader(own)  # parsed once, for every prompt line of both files
        if seq_len == "auto":
            # text is cut into full rows, so its documents' lengths do not bound a row
            longest = tokens.longest if fmt != "text" and len(tokens) else 256
            # a prompt's row fits it and its answer, up to the model's positions
            cap = limit if fmt == "prompts" else 512
            seq_len = auto.seq_len(longest + room, limit, cap=cap)
        if room >= min(seq_len, limit):
            raise DataError(
                f"hyperparameters.max_completion_tokens {room} leaves no room for a prompt in "
                f"rows of {min(seq_len, limit)} tokens (the model has {limit} positions)"
            )
        if seq_len > limit:
            raise DataError(
                f"hyperparameters.seq_len {seq_len} exceeds the model's {limit} positions"
            )
        packing: dict[str, Any] = {"requested": hp.packing, "packed": False}
        if fmt in ("chat", "completion"):  # text is cut, pairs are never packed
            share = padding_share(tokens, seq_len)
            packing.update(
                packed=auto.packing(hp.packing, share), padding_share_unpacked=round(share, 4)
            )
        packed = packing["packed"]
        if fmt == "prompts":
            train = _prompts(tok, tokens, seq_len, room, train_path, sample, out, "train", grader)
        else:
            train = build_rows(tok, fmt, tokens, seq_len, packed, out, "train")
        _check_train_rows(train, fmt, seq_len - room)
        valid = None
        if valid_path is not None and vfmt is not None:
            vtokens = tokenize(tok, vfmt, iter_examples(valid_path, sample), _under(work, "valid"))
            if vfmt == "prompts":
                valid = _prompts(
                    tok, vtokens, seq_len, room, valid_path, sample, out, "valid", grader
                )
            else:
                valid = build_rows(tok, vfmt, vtokens, seq_len, packed, out, "valid")
            if valid.input_ids.shape[0] == 0:
                raise DataError("the validation file has no rows to evaluate at this seq_len")
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    rows_ = train.input_ids.shape[0]
    sampled = None
    whole = spec.training_file.examples
    if sample is not None and train.examples >= sample and whole > train.examples:
        sampled = {"examples": train.examples, "of": whole}
        rows_ = math.ceil(rows_ * whole / train.examples)  # the whole file's, scaled
    per_epoch = math.ceil(rows_ / hp.batch_size)
    total = per_epoch * hp.n_epochs
    if hp.max_steps:
        total = min(total, hp.max_steps)
    return Prepared(tok, train, valid, seq_len, fmt, per_epoch, total, packing, sampled)


def _prompts(
    tok: Any,
    tokens: Tokens,
    seq_len: int,
    room: int,
    path: Path,
    sample: int | None,
    out: Path | None,
    split: str,
    grader: Any,
) -> Encoded:
    """Reinforcement prompts' rows, and beside them (`<split>_items.jsonl` under `out`) the
    item each kept prompt's grader sees, in row order; a line whose item lacks a key the
    grader's templates name is a `DataError` (job creation checked the first lines)."""
    from service.errors import InvalidRequest
    from service.methods.graders import check_item

    enc, kept = prompt_rows(tok, tokens, seq_len, room, out, split)
    wanted = set(kept.tolist())
    f = (out / f"{split}_items.jsonl").open("w", encoding="ascii") if out is not None else None
    try:
        for k, ex in enumerate(iter_examples(path, sample)):
            item = prompt_item(ex)
            if grader is not None:  # every line's item against the grader's templates
                try:
                    check_item(grader, item, "grader")
                except InvalidRequest as e:
                    raise DataError(f"the {split} file's line {k + 1}: {e.message}") from None
            if f is not None and k in wanted:
                f.write(json.dumps(item) + "\n")  # ASCII: a lone surrogate is escaped
    finally:
        if f is not None:
            f.close()
    return enc


def _grader(own: dict[str, Any]) -> Any:
    """The reinforcement grader a spec's hyperparameters carry, parsed (None: none)."""
    if "grader" not in own:
        return None
    from service.methods.graders import parse_grader

    return parse_grader(own["grader"], python=True, embeddings=True)


def _under(work: Path | None, name: str) -> Path | None:
    return work / name if work is not None else None


def _check_train_rows(train: Encoded, fmt: str, seq_len: int) -> None:
    if train.input_ids.shape[0] > 0:
        return
    if fmt == "prompts":
        raise DataError(
            f"no training prompts: all {train.examples} are longer than {seq_len} tokens, "
            "which leaves the answer its hyperparameters.max_completion_tokens; raise "
            "hyperparameters.seq_len or shorten the prompts"
        )
    if fmt == "text":
        # text rows are full cuts of the concatenated documents: a short text fills none
        raise DataError(
            f"no training rows: the text is shorter than one row of seq_len {seq_len} "
            "tokens; lower hyperparameters.seq_len or add text"
        )
    raise DataError(
        f"no training rows: {train.dropped} example(s) had nothing left to train on "
        f"within seq_len {seq_len}; raise hyperparameters.seq_len"
    )


def prepare_files(
    spec: JobSpec,
    train_path: Path,
    valid_path: Path | None,
    tokenizer_cache: Path,
    data_file: Path,
) -> dict[str, Any]:
    """A job's data preparation where it runs (a Ray task on a worker, see
    `service.control.driver`): tokenize the whole files as they stream, write the rows
    under `data_file` (a directory, `service.data.rows.load_rows` reads it) and their
    report beside it (`.json`), and return the report, which is small; its `error` is the
    `DataError`'s message when the data is unusable (nothing is written then)."""
    tmp = fresh(data_file)
    try:
        prep = prepare(spec, train_path, valid_path, tokenizer_cache=tokenizer_cache, out=tmp)
    except DataError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return {"error": str(e)}
    publish(tmp, data_file)
    meta = {**prep.report(), "vocab_size": len(prep.tokenizer)}
    if prep.train.packed:
        meta["layout"] = f"packed, {meta['training_file']['examples_per_row']:.1f} examples per row"
    elif prep.format == "preference":
        meta["layout"] = "a row per answer of each pair"
    elif prep.format == "prompts":
        meta["layout"] = "a row per prompt, its answers sampled after it"
    else:
        meta["layout"] = "one example per row"
    tmp_meta = data_file.with_suffix(".json.tmp")
    tmp_meta.write_text(json.dumps(meta))
    os.replace(tmp_meta, data_file.with_suffix(".json"))
    return meta


def _method_format_mismatch(what: str, fmt: str, method: methods.Method) -> str:
    takers = " or ".join(f"'{m.name}'" for m in methods.taking(fmt)) or "none"
    return (
        f"the {what} holds {fmt} examples, and method.type '{method.name}' trains on "
        f"{method.wants} (one per line); methods that train on {fmt} examples: {takers}"
    )


def build_rows(
    tok: Any,
    fmt: str,
    tokens: Tokens,
    seq_len: int,
    packed: bool,
    out: Path | None = None,
    split: str = "train",
) -> Encoded:
    """A split's rows as its format lays them out (under `out` when given)."""
    if fmt == "text":
        return text_rows(tokens, seq_len, out, split)
    if fmt == "preference":
        return pair_rows(tok, tokens, seq_len, out, split)
    return rows(tok, tokens, seq_len, packed, out, split)


def encode(tok: Any, fmt: str, examples: Iterable[dict[str, Any]], seq_len: int) -> Encoded:
    """Examples in memory as rows of `seq_len`, one example per row (tests, `pstar train`)."""
    return build_rows(tok, fmt, tokenize(tok, fmt, examples), seq_len, packed=False)


def zoo_hf_config(name: str, vocab: int, seq_len: int):
    """A zoo GPT as a transformers GPT-2 config (same shape: learned positions, pre-LN,
    tanh GELU, tied embeddings), so a from-scratch job exports like any other."""
    from transformers import GPT2Config

    from pstar_core.models import get_config

    z = get_config(name)
    return GPT2Config(
        vocab_size=vocab,
        n_positions=seq_len,
        n_embd=z.hidden_size,
        n_layer=z.num_layers,
        n_head=z.num_heads,
        n_inner=z.hidden_size * z.ffn_mult,
        activation_function="gelu_new",
        resid_pdrop=z.dropout,
        embd_pdrop=z.dropout,
        attn_pdrop=z.dropout,
        layer_norm_epsilon=z.layer_norm_eps,
        initializer_range=z.init_std,
        tie_word_embeddings=z.tie_embeddings,
        bos_token_id=0,
        eos_token_id=0,
    )


def model_fn(model: dict[str, Any], seq_len: int, vocab: int):
    """What `pstar_core.initialize` takes for the plan's model: a HF directory, or a
    callable building the zoo model (on the meta device, inside `initialize`)."""
    if model["kind"] != "zoo":
        return Path(model["path"])
    from transformers import GPT2LMHeadModel

    cfg = zoo_hf_config(model["id"], vocab, seq_len)
    return lambda: GPT2LMHeadModel(cfg)
