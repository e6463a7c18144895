from aisyn.data.detokenizer import REPLACEMENT, IncrementalDetokenizer

TEXT = "新华社北京１月１日电 我们 hello\n鼗鼗𠀀。"  # rare characters: byte pieces


def test_streamed_pieces_are_whole_characters_and_add_up(tokenizer):
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer)

    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())

    assert "".join(pieces) == tokenizer.decode(ids) == TEXT
    assert not any(REPLACEMENT in p for p in pieces)
    # The byte-spelled characters really were held back, token by token.
    assert sum(p == "" for p in pieces) > 5


def test_flush_lets_an_unfinished_character_through(tokenizer):
    ids = tokenizer.encode("𠀀")  # four byte pieces (and a word boundary)
    detok = IncrementalDetokenizer(tokenizer)

    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.flush().endswith(REPLACEMENT)
    assert detok.flush() == ""
