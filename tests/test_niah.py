"""Needle in a haystack: prompts put the needle where asked, in a context of the asked length, and the
default model reads it back."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from quantkit.eval import niah

TEXT = " ".join(f"Sentence number {i} talks about the weather in a small town." for i in range(400))


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 0.9, 1.0])
def test_needle_sits_at_its_depth_in_a_context_of_the_asked_length(tokenizer, depth):
    sentences = niah._sentences(TEXT)
    ids = niah.build_prompt(tokenizer, sentences, 600, depth, "4829305")
    assert len(ids) == 600
    needle = tokenizer.encode(" " + niah.NEEDLE.format(number="4829305"), add_special_tokens=False)
    question = tokenizer.encode(niah.QUESTION, add_special_tokens=False)
    assert ids[-len(question):] == question
    starts = [i for i in range(len(ids)) if ids[i:i + len(needle)] == needle]
    assert len(starts) == 1
    haystack = 600 - len(needle) - len(question)
    sentence = len(tokenizer.encode(" " + sentences[1], add_special_tokens=False))
    assert abs(starts[0] - depth * haystack) <= sentence  # between sentences, next to the depth


def test_bad_requests_are_refused(tokenizer):
    with pytest.raises(ValueError, match="depth"):
        niah.build_prompt(tokenizer, niah._sentences(TEXT), 600, 1.5, "1")
    with pytest.raises(ValueError, match="cannot hold"):
        niah.build_prompt(tokenizer, niah._sentences(TEXT), 10, 0.5, "1")


def test_answers_are_scored_by_their_first_number():
    assert niah.Trial(1, 0, "4829305", " 4829305.\nThe text").correct
    assert not niah.Trial(1, 0, "4829305", " 48293.").correct
    assert not niah.Trial(1, 0, "4829305", " unknown, sorry").correct


@pytest.mark.slow  # the default model, 9 generations
def test_default_model_retrieves_the_needle(default_model, tmp_path):
    from quantkit.cli import main

    plot = tmp_path / "niah.png"
    result = CliRunner().invoke(main, ["eval", "niah", "--model", str(default_model), "--lengths", "256,512",
                                       "--depths", "0,0.5,1", "--plot", str(plot), "--json"])
    assert result.exit_code == 0, result.output
    accuracy = json.loads(result.output)["accuracy"]
    assert all(v == 1.0 for row in accuracy.values() for v in row.values()), accuracy
    assert plot.read_bytes()[:4] == b"\x89PNG"
