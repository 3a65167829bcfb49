"""Run one of tinker-cookbook's recipes (`recipes/sl_loop.py`, `recipes/rl_loop.py`),
its own `main` and `Config`, against our server: in a process of its own, since the
cookbook configures the root logger and its loops take the API key from TINKER_API_KEY.

What would come from the HF Hub comes from this machine instead:
- the tokenizer, registered under the base model's name with the cookbook's own
  `register_tokenizer`;
- the dataset: `datasets.load_dataset` answers a local JSONL as the split "train";
- the renderer: the cookbook's model table knows hub names only, so our base model gets
  `role_colon`, the one it picks for base Llamas.

rl_loop grades GSM8K answers inside \\boxed{}, which a random tiny model never writes;
its reward is replaced by a local one (the share of the answer's characters that are
the row's `answer`), so groups differ and the loop trains.

    python tests/api/cookbook_runner.py sl|rl BASE_URL MODEL_DIR MODEL_NAME DATA LOG CONFIG_JSON
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    recipe, base_url, model_dir, model_name, data, log_path, config = argv
    import datasets
    from tinker_cookbook import model_info, tokenizer_utils
    from transformers import AutoTokenizer

    tokenizer_utils.register_tokenizer(model_name, lambda: AutoTokenizer.from_pretrained(model_dir))
    known = model_info.get_recommended_renderer_name
    model_info.get_recommended_renderer_name = lambda name: (
        "role_colon" if name == model_name else known(name)
    )
    with open(data, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    datasets.load_dataset = lambda *a, **k: datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows)}
    )
    if recipe == "sl":
        from tinker_cookbook.recipes import sl_loop as loop
    else:
        from tinker_cookbook.recipes import rl_loop as loop

        def reward(response: str, answer: str) -> float:
            return sum(ch == answer for ch in response) / max(1, len(response))

        loop.get_reward = reward  # type: ignore[assignment]
    loop.main(
        loop.Config(
            base_url=base_url, model_name=model_name, log_path=log_path, **json.loads(config)
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
