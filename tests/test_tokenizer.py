"""The built-in tiny tokenizer, checkpoint tokenizer files, chat template, incremental detokenizer."""

from __future__ import annotations

import pytest

from service.config import PRESETS
from service.sampling_params import InvalidRequest
from service.tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    IncrementalDetokenizer,
    Tokenizer,
    _train_bpe,
    build_tiny_tokenizer,
    get_tokenizer,
)

TOK = build_tiny_tokenizer(1024)
TEXTS = [
    "The model reads a sequence of tokens and predicts the next one.",
    "  leading spaces, tabs\tand\nnew lines  ",
    "Numbers: 3.14159, 2048, -7 and 1e-5.",
    "Ünïcödé: naïve café, こんにちは世界, привет, 🙂🚀👩‍👩‍👧 and a lone \u00a0nbsp",
]


def test_vocab_specials_and_determinism():
    assert TOK.vocab_size == 1024
    assert [TOK.hf.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert TOK.bos_token_id == 0 and TOK.eos_token_id == 1
    assert TOK.bos_token_id == PRESETS["tiny"].bos_token_id and TOK.eos_token_id == PRESETS["tiny"].eos_token_id
    assert _train_bpe(1024).to_str() == _train_bpe(1024).to_str()  # trained twice, same tokenizer


def test_large_vocab_is_padded_with_reserved_special_tokens():
    big = build_tiny_tokenizer(32768)
    assert big.vocab_size == 32768
    # Same merges as far as the corpus goes: ordinary text encodes identically.
    assert big.encode(TEXTS[0]) == build_tiny_tokenizer(4096).encode(TEXTS[0])
    reserved = big.hf.id_to_token(32767)
    assert reserved.startswith("<|reserved_")
    assert big.decode([32767, 300]) == big.decode([300]) and big.decode([32767], skip_special_tokens=False) == reserved
    assert max(big.encode(" ".join(TEXTS))) < 2000  # the padding is never produced by encode


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(text):
    ids = TOK.encode(text)
    assert ids[0] == TOK.bos_token_id and TOK.encode(text, add_bos=False) == ids[1:]
    assert TOK.decode(ids) == text
    assert TOK.decode(ids, skip_special_tokens=False) == "<|bos|>" + text
    # The corpus taught it merges: common English is well below a token per byte.
    if text is TEXTS[0]:
        assert len(ids) < len(text) / 2.5


def test_chat_template():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": [{"type": "text", "text": "How"}, {"type": "text", "text": " are you?"}]}]
    text = TOK.apply_chat_template(messages)
    assert text == ("<|system|>Be brief.<|eos|><|user|>Hi there<|eos|><|assistant|>Hello.<|eos|>"
                    "<|user|>How are you?<|eos|><|assistant|>")
    assert not TOK.apply_chat_template(messages[:2], add_generation_prompt=False).endswith("<|assistant|>")
    ids = TOK.encode(text)
    assert ids[:2] == [0, 4] and ids[-1] == 3 and ids.count(1) == 4  # role and EOS markers are single ids
    for bad, reason in [([], "non-empty"), ([{"role": "robot", "content": "x"}], "role"),
                        ([{"role": "user", "content": 5}], "content"), (["hi"], "object"),
                        ([{"role": "user", "content": [{"type": "image_url"}]}], "text parts")]:
        with pytest.raises(InvalidRequest, match=reason):
            TOK.apply_chat_template(bad)


def test_chat_template_is_sandboxed():
    evil = Tokenizer(TOK.hf, bos_token="<|bos|>", eos_token="<|eos|>",
                     chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(Exception, match="unsafe|not safely|attribute"):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def test_save_and_load(tmp_path):
    assert Tokenizer.from_directory(str(tmp_path)) is None
    TOK.save(str(tmp_path))
    loaded = Tokenizer.from_directory(str(tmp_path))
    assert loaded.vocab_size == 1024 and loaded.chat_template == CHAT_TEMPLATE
    assert loaded.bos_token_id == 0 and loaded.eos_token_id == 1
    for text in TEXTS:
        assert loaded.encode(text) == TOK.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.apply_chat_template(messages) == TOK.apply_chat_template(messages)


def test_get_tokenizer(tmp_path):
    assert get_tokenizer("tiny", PRESETS["tiny"]).vocab_size == 1024
    assert get_tokenizer("small", PRESETS["small"]).vocab_size == 32768
    assert get_tokenizer(str(tmp_path), PRESETS["tiny"]) is None
    TOK.save(str(tmp_path))
    assert get_tokenizer(str(tmp_path), PRESETS["tiny"]).encode("hi") == TOK.encode("hi")


def _deltas(tok: Tokenizer, ids: list[int], skip=True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    return [detok.add(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer(text):
    ids = TOK.encode(text)
    deltas = _deltas(TOK, ids)
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)
    assert "".join(_deltas(TOK, ids, skip=False)) == TOK.decode(ids, skip_special_tokens=False)


def test_incremental_detokenizer_holds_split_characters():
    ids = TOK.encode("🚀", add_bos=False)
    assert len(ids) >= 2  # not in the corpus: its 4 bytes span several tokens
    assert _deltas(TOK, ids) == [""] * (len(ids) - 1) + ["🚀", ""]
    # A sequence that ends mid-character shows the loss once, at the end.
    assert _deltas(TOK, ids[:2]) == ["", "", "\ufffd"]


def test_incremental_detokenizer_fallback_for_non_byte_level_tokenizers():
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "!": 3}
    hf = HF(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = Tokenizer(hf, bos_token=None, eos_token=None, chat_template=None)
    ids = tok.encode("hello world !")
    assert "".join(_deltas(tok, ids)) == tok.decode(ids)
    with pytest.raises(InvalidRequest, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_detokenizers_share_the_tokenizers_tables():
    """One IncrementalDetokenizer per sequence: the special-id and byte tables, and each token's
    bytes, come from the tokenizer, built once (the added-token table took 25-45 ms a sequence
    at 32768 tokens) and shared by every sequence."""
    tok = build_tiny_tokenizer(4096)
    a, b = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok)
    assert a._byte_of is b._byte_of is tok.byte_table
    ids = tok.encode("shared tables", add_bos=False)
    text_a = "".join(a.add(i) for i in ids) + a.flush()
    cached = {i: tok._token_bytes[True][i] for i in ids}
    assert "".join(b.add(i) for i in ids) + b.flush() == text_a == "shared tables"
    assert all(tok._token_bytes[True][i] is cached[i] for i in ids)  # b read a's entries
    assert tok.token_bytes(tok.eos_token_id, True) == b"" and tok.token_bytes(tok.eos_token_id, False) != b""
    assert tok.special_ids == {i for i, t in tok.hf.get_added_tokens_decoder().items() if t.special}
