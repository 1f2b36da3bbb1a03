"""The tokenizer on a small byte-level BPE built in the test (no model file needed)."""

from __future__ import annotations

import codecs
import random

import pytest

from ikcode.gateway.detokenize import IncrementalDetokenizer
from ikcode.model.tokenizer import CHATML_TEMPLATE, Tokenizer

MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("Ġw", "o"), ("Ġwo", "r")]
CORPUS = [
    "hello world",
    "def f(x):\n    return x + 1\n\n\n",
    "digits 1234567890 and 3.14159, 2026-11-29",
    "unicode: café naïve 日本語 😀👍🏽 Ωmega",
    "tabs\tand   spaces   \n\t  mixed\r\n",
    "",
    " ",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_vocab(merges=MERGES)


def test_round_trip(tok: Tokenizer) -> None:
    for text in CORPUS:
        assert tok.decode(tok.encode(text)) == text


def test_merges_apply_and_no_bos(tok: Tokenizer) -> None:
    ids = tok.encode("hello")
    assert ids == [tok.token_to_id("hello")]
    assert tok.encode(" wor") == [tok.token_to_id("Ġwor")]
    assert tok.bos_token_id is None or tok.encode("x")[0] != tok.bos_token_id


def test_digits_are_single_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("x 2048")
    assert [tok.id_to_token(i) for i in ids] == ["x", "Ġ", "2", "0", "4", "8"]


def test_special_tokens_are_single_ids(tok: Tokenizer) -> None:
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert tok.encode("<|im_start|>hello<|im_end|>") == [start, tok.token_to_id("hello"), end]
    assert tok.special_token_ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    assert tok.eos_token_ids == (end,)
    # Untrusted text can ask for special tokens to stay text.
    literal = tok.encode("<|im_end|>", allow_special=False)
    assert end not in literal and len(literal) > 1
    assert tok.decode(literal) == "<|im_end|>"


def test_vocab_size_counts_bytes_specials_and_merges(tok: Tokenizer) -> None:
    assert tok.vocab_size == 3 + 256 + len(MERGES)


def test_json_round_trip(tok: Tokenizer) -> None:
    again = Tokenizer.from_json(tok.to_json())
    assert again.eos_token_ids == tok.eos_token_ids and again.chat_template == CHATML_TEMPLATE
    for text in CORPUS:
        assert again.encode(text) == tok.encode(text)
    assert again.encode("<|im_end|>", allow_special=False) == tok.encode("<|im_end|>", allow_special=False)


def test_streamed_text_matches_the_whole_decode(tok: Tokenizer) -> None:
    rng = random.Random(7)
    text = "".join(CORPUS)
    ids = tok.encode(text)
    for _ in range(20):
        detok = IncrementalDetokenizer(tok)
        pieces, i = [], 0
        while i < len(ids):
            step = rng.randint(1, 3)
            pieces.append(detok.push(ids[i : i + step]))
            i += step
        pieces.append(detok.flush())
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)


def test_a_character_split_over_tokens_is_held_until_whole(tok: Tokenizer) -> None:
    ids = tok.encode("😀")  # four byte tokens
    assert len(ids) == 4
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids] == ["", "", "", "😀"]
    assert detok.flush() == ""


def test_a_reply_cut_inside_a_character_ends_before_it(tok: Tokenizer) -> None:
    ids = tok.encode("a😀")[:-1]  # the stream ends inside the emoji
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:1]) == "a"
    assert detok.push(ids[1:]) == ""
    assert detok.flush() == ""


def test_random_ids_never_emit_split_characters(tok: Tokenizer) -> None:
    """Random bytes: every invalid sequence comes out as U+FFFD as the whole decode has it, and
    only an incomplete last character is left out."""
    rng = random.Random(3)
    for _ in range(20):
        ids = [rng.randrange(3, tok.vocab_size) for _ in range(400)]
        detok = IncrementalDetokenizer(tok)
        out = "".join(detok.push([i]) for i in ids) + detok.flush()
        whole_characters = codecs.getincrementaldecoder("utf-8")("replace").decode(tok.token_bytes(ids))
        assert out == whole_characters


def test_token_bytes_are_what_decode_reads(tok: Tokenizer) -> None:
    """token_bytes follows the ByteLevel decoder: lossy UTF-8 of the bytes is decode's text, for
    any ids, added tokens among them."""
    rng = random.Random(5)
    for _ in range(200):
        ids = [rng.randrange(0, tok.vocab_size) for _ in range(rng.randint(1, 12))]
        assert tok.token_bytes(ids).decode("utf-8", "replace") == tok.decode(ids)


def test_a_replacement_character_the_model_wrote_is_neither_held_nor_dropped(tok: Tokenizer) -> None:
    ids = tok.encode("a\ufffd")
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids) == "a\ufffd"  # not held back as if a character were still coming
    assert detok.flush() == ""
    assert len(ids) == 4  # "a" and U+FFFD's three bytes
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:1]) == "a"
    assert detok.push(ids[1:3]) == ""  # two of its bytes: a character under way
    assert detok.push(ids[3:]) == "\ufffd"
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:1]) == "a"
    assert detok.push(ids[1:3]) == ""
    assert detok.flush() == ""  # cut there: left out


class _TextOnly:
    """A tokenizer that gives no bytes (not byte-level): text ending in U+FFFD is taken as cut."""

    def __init__(self, tok: Tokenizer):
        self.decode, self.encode, self.token_to_id = tok.decode, tok.encode, tok.token_to_id


def test_without_bytes_a_trailing_replacement_character_is_taken_for_a_cut_one(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(_TextOnly(tok))
    assert detok.push(tok.encode("a\ufffd")) == ""
    assert detok.flush() == "a"


@pytest.mark.parametrize("marker", ["<|im_end|>", "<|im_start|>"])
def test_user_text_cannot_spell_a_marker_added_as_a_plain_token(tok: Tokenizer, marker: str) -> None:
    """A fine-tune that added its chat markers as ordinary tokens (tokenizer.json `special:
    false`, a GGUF user-defined token): user text spelling one became the marker itself, and
    closed its own turn."""
    import json

    data = json.loads(tok.backend.to_str())
    for added in data["added_tokens"]:
        added["special"] = False
    plain = Tokenizer.from_tokenizer_json(json.dumps(data), {"eos_token": "<|im_end|>"})
    marker_id = plain.token_to_id(marker)
    assert plain.encode(f"x{marker}", allow_special=True)[-1] == marker_id  # the template's own use
    assert marker_id not in plain.encode(f"x{marker}y", allow_special=False)
