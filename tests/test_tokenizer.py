"""Tokenization as the release's transformers CLIPTokenizer (ftfy cleaning, special tokens,
end-of-text padding), on open_clip's BPE vocabulary.

Expected ids are written as the word pieces the release's pipeline produces, looked up in
the vocabulary one by one; open_clip's own tokenizer gives other ids for these captions.
"""

from __future__ import annotations

import open_clip
import pytest
import torch

from uvic.models.text_encoder import ReleaseTokenizer

TOKENIZER = ReleaseTokenizer()
BPE = open_clip.SimpleTokenizer()
SOT, EOT = 49406, 49407


def piece_ids(*pieces: str) -> list[int]:
    """Vocabulary ids of pre-split word pieces (each a whole word: BPE may split it)."""
    out = []
    for piece in pieces:
        token = "".join(BPE.byte_encoder[b] for b in piece.encode("utf-8"))
        out += [BPE.encoder[t] for t in BPE.bpe(token).split(" ")]
    return out


def row(ids: list[int]) -> list[int]:
    """The release's 77 ids: start, ids, end, end-of-text padding."""
    full = [SOT, *ids, EOT]
    return full + [EOT] * (77 - len(full))


CASES = {
    # ftfy leaves entities without ';' alone; open_clip's html.unescape decodes them
    "fish &amp chips": piece_ids("fish", "&", "amp", "chips"),
    # ftfy leaves text containing '<' alone
    "x < y &amp; z": piece_ids("x", "<", "y", "&", "amp", ";", "z"),
    "&copy 2014": piece_ids("&", "copy", "2", "0", "1", "4"),
    "It&#39s": piece_ids("it", "&#", "3", "9", "s"),
    # a complete entity without '<' is decoded, as in the release
    "fish &amp; chips": piece_ids("fish", "&", "chips"),
    # the release's special tokens are special inside a caption; what follows stays
    "a <|endoftext|> b c": [*piece_ids("a"), EOT, *piece_ids("b", "c")],
    "<|startoftext|>Hello": [SOT, *piece_ids("hello")],
    "A <|ENDOFTEXT|> b": [*piece_ids("a"), EOT, *piece_ids("b")],  # lower-cased, then special
    # open_clip's special token is plain text in the release
    "<end_of_text> x": piece_ids("<", "end", "_", "of", "_", "text", ">", "x"),
    # whitespace collapsed, lower case
    "  Two\tCATS\n on a  MAT ": piece_ids("two", "cats", "on", "a", "mat"),
}


@pytest.mark.parametrize("text", list(CASES))
def test_release_ids(text: str) -> None:
    assert TOKENIZER([text])[0].tolist() == row(CASES[text])


def test_unusual_captions_differ_from_open_clip() -> None:
    """The cases above are the ones where open_clip's tokenizer disagrees."""
    theirs = open_clip.get_tokenizer("ViT-L-14-quickgelu")(list(CASES)[:4])
    ours = TOKENIZER(list(CASES)[:4])
    assert all(not torch.equal(a, b) for a, b in zip(ours, theirs))


def test_ordinary_captions_equal_open_clip_up_to_padding() -> None:
    texts = ["A red double decker bus driving down a city street.", "", "café, 3 cats!",
             "ÜBER 100 % Naïve", "it's a dog's life"]
    theirs = open_clip.get_tokenizer("ViT-L-14-quickgelu")(texts)
    ours = TOKENIZER(texts)
    for a, b in zip(ours, theirs):
        end = b.tolist().index(EOT)
        assert a[: end + 1].tolist() == b[: end + 1].tolist()
        assert (a[end + 1:] == EOT).all() and (b[end + 1:] == 0).all()


def test_long_captions_keep_the_end_token() -> None:
    text = " ".join(["word"] * 100)
    ids = TOKENIZER([text])[0].tolist()
    assert ids == [SOT, *piece_ids("word") * 75, EOT]
    with pytest.raises(TypeError):
        TOKENIZER("a single string")
