"""`pstar bench rft`'s task, without running the job (the benchmark runs a real model for
minutes; its figures are in docs/graders.md): WordNet synsets become prompts whose items
the grader reads, and the grader passes exactly the synonyms."""

from __future__ import annotations

import json

import pytest

from benchmarks.rft import GRADER, _lines, synonym_prompts
from service.data.datasets import classify, prompt_item
from service.methods.graders import check_item, grade, parse_grader

# WordNet's data.noun layout: offset, lex file, type, word count (hex), then word, lex id
DATA_NOUN = """\
  1 This software and database is being provided to you, the LICENSEE, by
00007846 03 n 07 person 0 individual 0 someone 0 somebody 0 mortal 0 soul 0 human_being 0 000 | one
00015388 03 n 01 animal 0 000 | a living organism
00017222 03 n 02 plant 0 flora 0 000 | a living organism lacking locomotion
00017223 03 n 02 flora 0 plant 0 000 | the plants of a region
00019128 03 n 02 big_cat 0 cat 0 000 | any large cat
"""


@pytest.fixture
def wordnet(tmp_path):
    (tmp_path / "data.noun").write_text(DATA_NOUN)
    return tmp_path


def test_synsets_with_two_one_word_lemmas_become_prompts_each_word_asked_once(wordnet):
    got = synonym_prompts(wordnet)
    # animal has no synonym; human_being and big_cat are not one word; flora was asked
    # (as plant's synonym, then as a synset of its own: asked once, by its first lemma)
    assert got == [
        ("person", ["individual", "someone", "somebody", "mortal", "soul"]),
        ("plant", ["flora"]),
        ("flora", ["plant"]),
    ]


def test_the_lines_are_prompts_whose_items_the_grader_reads(wordnet):
    lines = _lines(synonym_prompts(wordnet)).decode().splitlines()
    grader = parse_grader(GRADER)
    for line in lines:
        obj = json.loads(line)
        assert classify(obj) == ("prompts", None)
        check_item(grader, prompt_item(obj), "grader")
    person = prompt_item(json.loads(lines[0]))
    passed = {
        answer: grade(grader, answer, person).sub_rewards["exact"]
        for answer in ("individual", "Soul", "soul.", "a person", "someone else", "individ")
    }
    # exactly one of the synonyms, in any case; nothing around it, no part of one
    assert passed == {
        "individual": 1.0, "Soul": 1.0, "soul.": 0.0, "a person": 0.0,
        "someone else": 0.0, "individ": 0.0,
    }  # fmt: skip
    # `close` gives a shorter, nearer answer more, so a sentence still ranks below
    near = grade(grader, "individuals", person)
    far = grade(grader, "The word person means a human", person)
    assert near.reward > far.reward > 0
