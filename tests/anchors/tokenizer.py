"""A tiny word-level tokenizer made in code, so reference engines that insist on loading a
tokenizer can run a random checkpoint with no download. Token i is spelled `t{i}`; the
first four ids are the specials that config.json names (bos 0, eos 1)."""

from __future__ import annotations

import json
import os

SPECIALS = ["<bos>", "<eos>", "<pad>", "<unk>"]


def write_tokenizer(directory: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": 4096,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
