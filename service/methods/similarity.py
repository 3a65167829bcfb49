"""The text-similarity metrics of OpenAI's `text_similarity` grader, each computed by the
library most users of the metric know (service/methods/graders.py lists them), on at most
the first MAX_SIMILARITY_WORDS words (MAX_FUZZY_CHARS characters for fuzzy_match) of each
side; and the machine's WordNet made readable by NLTK, for METEOR's synonyms."""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

from service.errors import InvalidRequest

MAX_SIMILARITY_WORDS = 1024  # what BLEU, GLEU, METEOR and ROUGE compare of each side
MAX_FUZZY_CHARS = 10_000  # what fuzzy_match compares of each side
_WORDS = re.compile(r"\w+|[^\w\s]")


def similarity(metric: str, text: str, ref: str) -> float:
    """`metric` of `text` against `ref`, on at most the first MAX_FUZZY_CHARS characters
    (fuzzy_match) or MAX_SIMILARITY_WORDS words (the others) of each: ROUGE-L and METEOR
    cost the product of the two lengths."""
    if metric == "fuzzy_match":
        from rapidfuzz import fuzz

        return fuzz.ratio(text[:MAX_FUZZY_CHARS], ref[:MAX_FUZZY_CHARS]) / 100.0
    if metric.startswith("rouge_"):
        key = "rougeL" if metric == "rouge_l" else f"rouge{metric[-1]}"
        cut = " ".join(text[: MAX_SIMILARITY_WORDS * 64].split()[:MAX_SIMILARITY_WORDS])
        ref_cut = " ".join(ref[: MAX_SIMILARITY_WORDS * 64].split()[:MAX_SIMILARITY_WORDS])
        return float(_rouge(key).score(ref_cut, cut)[key].fmeasure)
    # words are rarely longer than 64 characters: cut before splitting a megabyte
    hyp = _WORDS.findall(text[: MAX_SIMILARITY_WORDS * 64])[:MAX_SIMILARITY_WORDS]
    refs = [_WORDS.findall(ref[: MAX_SIMILARITY_WORDS * 64])[:MAX_SIMILARITY_WORDS]]
    if not hyp or not refs[0]:
        return float(hyp == refs[0])
    if metric == "bleu":
        from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

        return float(sentence_bleu(refs, hyp, smoothing_function=SmoothingFunction().method1))
    if metric == "gleu":
        from nltk.translate.gleu_score import sentence_gleu

        return float(sentence_gleu(refs, hyp))
    if metric == "meteor":
        from nltk.translate.meteor_score import meteor_score

        wordnet = _wordnet()
        with _WORDNET_READS:  # NLTK's reader seeks and reads one shared file handle
            return float(meteor_score(refs, hyp, wordnet=wordnet))
    raise ValueError(f"no similarity metric {metric!r}")  # parse_grader refused it


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine of the angle between embeddings `a` and `b`; 0 when either is all zeros."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na > 0 and nb > 0 else 0.0


@functools.cache
def _rouge(key: str) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([key])


def wordnet_dir() -> Path | None:
    """WordNet 3.0's database files on this machine (Debian's wordnet-base), if any."""
    for d in (os.environ.get("WNSEARCHDIR"), "/usr/share/wordnet"):
        if d and Path(d, "data.noun").is_file():
            return Path(d)
    return None


# NLTK's WordNet reader wants a `lexnames` file, which Debian's package does not ship: the
# 45 lexicographer files of WordNet 3.0, in order, with their syntactic category.
_LEXNAMES = """
adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute
noun.body noun.cognition noun.communication noun.event noun.feeling noun.food noun.group
noun.location noun.motive noun.object noun.person noun.phenomenon noun.plant
noun.possession noun.process noun.quantity noun.relation noun.shape noun.state
noun.substance noun.time verb.body verb.change verb.cognition verb.communication
verb.competition verb.consumption verb.contact verb.creation verb.emotion verb.motion
verb.perception verb.possession verb.social verb.stative verb.weather adj.ppl
"""
_CATEGORY = {"noun": 1, "verb": 2, "adj": 3, "adv": 4}


_WORDNET_READS = threading.Lock()


@functools.cache
def _wordnet() -> Any:
    """NLTK's WordNet reader over a copy of this machine's WordNet (NLTK reads corpora only
    from its own data directories), made once in ~/.cache/pstar/nltk_data."""
    import nltk
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    source = wordnet_dir()
    if source is None:
        raise InvalidRequest("meteor needs WordNet 3.0, which this server lacks")
    root = Path(os.environ.get("PSTAR_CACHE_DIR", Path.home() / ".cache" / "pstar"))
    data = root / "nltk_data"
    corpus = data / "corpora" / "wordnet"
    if not corpus.is_dir():  # made whole in a directory of its own, then renamed in place
        corpus.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="wordnet.", dir=corpus.parent))
        for f in source.iterdir():
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)
        names = _LEXNAMES.split()
        lines = [f"{i:02d}\t{n}\t{_CATEGORY[n.split('.')[0]]}" for i, n in enumerate(names)]
        (tmp / "lexnames").write_text("\n".join(lines) + "\n")
        try:
            tmp.rename(corpus)
        except OSError:  # another process or thread made it meanwhile: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    if str(data) not in nltk.data.path:
        nltk.data.path.append(str(data))

    class EnglishWordNet(WordNetCorpusReader):
        def map_wn(self, version: str = "wordnet") -> None:
            """No mapping to another WordNet's synsets (it is for the multilingual Open
            Multilingual Wordnet, and needs `index.sense`, which Debian does not ship)."""
            return None

    with warnings.catch_warnings():  # "multilingual functions are not available": right
        warnings.simplefilter("ignore")
        return EnglishWordNet(str(corpus), None)
