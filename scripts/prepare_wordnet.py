"""Build a small chat fine-tuning dataset from WordNet 3.0: "What does 'X' mean?" -> its gloss.

The machine has no dataset hub, but Debian's `wordnet-base` package ships WordNet 3.0's
database files, whose word -> definition pairs make a real, public instruction dataset.
This script reads `data.noun` (and `data.verb` / `data.adj` when present) and writes
`wordnet-train.jsonl` and `wordnet-valid.jsonl` in OpenAI's chat fine-tuning format, one
`{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}` object per line.

Each synset gives one pair: its first word (underscores -> spaces, adjective markers such as
"(a)" dropped) and its gloss without the example sentences (the `; "..."` parts). Synsets
whose gloss is empty or longer than 200 characters are skipped, and each word is kept once
(its first synset in file order), so no question has two answers and no word is in both
files. The split is a seeded shuffle: the same arguments always give the same files.
Stdlib only. Exits 2 if WordNet is missing; does nothing if both outputs already exist.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_FILES = ("data.noun", "data.verb", "data.adj")
MAX_GLOSS = 200
ADJ_MARKER = re.compile(r"\((?:a|p|ip)\)$")


def find_wordnet_dir() -> Path | None:
    """The directory holding `data.noun`: $WNSEARCHDIR, then `dpkg -L wordnet-base`, then
    Debian's usual /usr/share/wordnet."""
    candidates = [Path(os.environ["WNSEARCHDIR"])] if os.environ.get("WNSEARCHDIR") else []
    try:
        listing = subprocess.run(
            ["dpkg", "-L", "wordnet-base"], capture_output=True, text=True, check=False
        ).stdout
        candidates += [Path(p).parent for p in listing.splitlines() if p.endswith("/data.noun")]
    except OSError:
        pass
    candidates.append(Path("/usr/share/wordnet"))
    return next((d for d in candidates if (d / "data.noun").is_file()), None)


def parse_line(line: str) -> tuple[str, str] | None:
    """(first word, cleaned gloss) of one data-file line, or None for the license header
    and for glosses that are empty or too long."""
    if not line[:1].isdigit() or " | " not in line:
        return None
    fields, gloss = line.split(" | ", 1)
    word = ADJ_MARKER.sub("", fields.split()[4]).replace("_", " ").strip()
    gloss = gloss.split('; "', 1)[0].strip().rstrip(";").strip()
    if not word or not gloss or len(gloss) > MAX_GLOSS:
        return None
    return word, gloss


def load_pairs(wordnet_dir: Path) -> list[tuple[str, str]]:
    """One (word, gloss) pair per distinct word (case-insensitive), in file order."""
    pairs: dict[str, tuple[str, str]] = {}
    for name in DATA_FILES:
        path = wordnet_dir / name
        if not path.is_file():
            continue
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                pair = parse_line(line)
                if pair is not None:
                    pairs.setdefault(pair[0].casefold(), pair)
    return list(pairs.values())


def write_jsonl(path: Path, pairs: list[tuple[str, str]]) -> None:
    """Write via a temporary file and rename, so an interrupted run leaves no partial output."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for word, gloss in pairs:
            user = {"role": "user", "content": f"What does '{word}' mean?"}
            assistant = {"role": "assistant", "content": gloss}
            f.write(json.dumps({"messages": [user, assistant]}, ensure_ascii=False) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".cache" / "data")
    parser.add_argument("--train", type=int, default=2000, help="training examples")
    parser.add_argument("--valid", type=int, default=200, help="validation examples")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffle")
    args = parser.parse_args(argv)
    train_path, valid_path = args.out / "wordnet-train.jsonl", args.out / "wordnet-valid.jsonl"
    if all(p.is_file() and p.stat().st_size > 0 for p in (train_path, valid_path)):
        print(f"prepare_wordnet: {train_path} and {valid_path} already exist, skipping")
        return 0
    wordnet_dir = find_wordnet_dir()
    if wordnet_dir is None:
        print(
            "prepare_wordnet: WordNet's data.noun not found; install Debian's wordnet-base "
            "package (apt-get install wordnet-base) or set WNSEARCHDIR",
            file=sys.stderr,
        )
        return 2
    pairs = load_pairs(wordnet_dir)
    if args.train < 0 or args.valid < 0 or args.train + args.valid > len(pairs):
        parser.error(f"--train + --valid must be between 0 and {len(pairs)} (usable words)")
    random.Random(args.seed).shuffle(pairs)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(train_path, pairs[: args.train])
    write_jsonl(valid_path, pairs[args.train : args.train + args.valid])
    print(
        f"prepare_wordnet: {args.train} train -> {train_path}, "
        f"{args.valid} valid -> {valid_path} (from {len(pairs)} words in {wordnet_dir})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
