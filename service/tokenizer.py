"""Tokenizers: the built-in tiny byte-level BPE for presets, checkpoint tokenizers, incremental detok.

The tiny tokenizer is trained in code at build time on `_CORPUS` below with Hugging Face
`tokenizers` (deterministic: same corpus, same trainer settings, same merges). Ids 0-4 are the
special tokens, then the 256 byte symbols, then merges. When the corpus cannot fill `vocab_size`
(it runs out of merges near 1.4k entries), the rest is padded with special tokens
`<|reserved_N|>`: they are never produced by `encode` on ordinary text and decode to nothing
with skip_special_tokens, so a model with a large vocabulary (32768) still gets exactly
`vocab_size` ids.
"""

from __future__ import annotations

import codecs
import functools
import json
import os
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from .config import PRESETS, ConfigError, ModelConfig
from .sampling_params import InvalidRequest

BOS, EOS = "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = [BOS, EOS, "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_ROLES = ("system", "user", "assistant")

# Each turn opens with its role token and ends with EOS, so a model stops after its own turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|eos|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = """\
The service answers questions about the weather, the sea and the small towns along the coast.
In the morning the fishermen check their nets, and the market opens before the sun is high.
A train leaves the station every hour; the last one goes at half past eleven in the evening.
Children walk to school along the river, counting the boats and the birds on the water.
She said that the report would be ready on Monday, but the numbers were still changing.
We measured the temperature of the water at three depths and wrote the values in a table.
The model reads a sequence of tokens and predicts the next one, one step after another.
Every layer mixes information from earlier positions and passes its result to the next layer.
When the cache is full, the oldest request keeps its memory and the newest one waits.
Please send the files before noon, and let me know if anything is missing or broken.
How many people live in the city? About four hundred thousand, and the number is growing.
What time is it now? It is a quarter to seven, and dinner will be served at eight o'clock.
He opened the window, listened to the rain for a while, and then went back to his book.
The library keeps old maps of the region, drawn by hand more than two hundred years ago.
Our team builds tools for training and serving language models on many accelerators.
The function returns a list of numbers; if the input is empty, it returns an empty list.
Weights are loaded from disk, copied to the device, and checked against a known checksum.
After the update the service reports a new version, so clients know which policy answered.
A good test fails when the code is wrong and passes when the code is right, every time.
The garden behind the house has apple trees, a small pond and a bench under an old oak.
In winter the road over the mountain is closed, and the village is reached only by boat.
They agreed to meet at the corner of the square, next to the bakery with the blue door.
The committee will review the proposal next week and publish its decision in the spring.
Numbers such as 1, 2, 3, 10, 42, 100, 256, 1024 and 2048 appear often in technical text.
Prices rose by 3.5% last year, while wages grew by only 2.1%, according to the survey.
The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.
Read the instructions carefully, write your answer clearly, and check it before you finish.
If you are not sure, ask a question; it is better to ask than to guess and be wrong.
The user asked the assistant to summarise the article in three short sentences.
The assistant replied politely, gave a clear answer, and offered to explain further.
A system message sets the rules of the conversation before the first user message.
Good morning! How are you today? I am fine, thank you, and I hope you are well too.
The bridge was built in 1887, rebuilt after the flood of 1953, and painted red in 2004.
Light travels faster than sound, which is why we see lightning before we hear thunder.
Water boils at one hundred degrees at sea level, but at a lower temperature in the hills.
The museum is open from Tuesday to Sunday; on Monday it is closed for cleaning and repairs.
Some words come from other languages: café, naïve, résumé, façade, jalapeño and über.
Greetings in other scripts: こんにちは, 你好, привет, γειά σου, and a smile 🙂 or a star ⭐.
The store sells bread, milk, cheese, eggs, fruit and vegetables, and it closes at nine.
Engineers often write small programs to test an idea before they build the real thing.
The memory pool keeps track of every tensor, its size, its address and its owner.
Sleep mode frees the memory of the weights, and wake up maps fresh memory at the same place.
On the first day of the trip we walked along the cliffs and watched the waves below.
The teacher wrote a long equation on the board and asked the class to solve it together.
My brother plays the piano, my sister paints, and I like to cook for the whole family.
The recipe needs two cups of flour, one egg, a spoon of sugar and a little salt.
After the storm the streets were full of leaves, branches and puddles of muddy water.
This sentence is here to add a few more common words: about, above, across, after, again.
Because, before, behind, below, beside, between, beyond, during, except, inside, outside.
Always, never, often, sometimes, usually, rarely, today, tomorrow, yesterday, tonight.
Red, orange, yellow, green, blue, indigo and violet are the colours of the rainbow.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday make up the week.
January, February, March, April, May, June, July, August, September, October, November.
"""


def _train_bpe(vocab_size: int) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    short = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if short > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(short)])
    return tok


@functools.lru_cache(maxsize=4)
def build_tiny_tokenizer(vocab_size: int = 1024) -> Tokenizer:
    minimum = len(SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ConfigError(f"the tiny tokenizer needs vocab_size >= {minimum}, got {vocab_size}")
    hf = _train_bpe(vocab_size)
    if hf.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError(f"tiny tokenizer has {hf.get_vocab_size(with_added_tokens=True)} ids, not {vocab_size}")
    return Tokenizer(hf, bos_token=BOS, eos_token=EOS, chat_template=CHAT_TEMPLATE)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what serving needs: BOS/EOS ids and a chat template."""

    def __init__(self, hf: HFTokenizer, *, bos_token: str | None, eos_token: str | None,
                 chat_template: str | None) -> None:
        self.hf = hf
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = hf.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = hf.token_to_id(eos_token) if eos_token else None
        self.chat_template = chat_template
        self._template = None
        self._token_bytes: dict[bool, dict[int, bytes]] = {False: {}, True: {}}

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special added tokens, computed once: the `tokenizers` call behind it
        builds the whole added-token table, 25-45 ms at the 32768-token presets' vocabulary, and
        it ran for every sequence (6 s of a 256-request wave on the H200's offline engine)."""
        return frozenset(i for i, t in self.hf.get_added_tokens_decoder().items() if t.special)

    @functools.cached_property
    def byte_table(self) -> dict[str, int] | None:
        return _byte_level_table(self.hf)

    def token_bytes(self, token_id: int, skip_special_tokens: bool) -> bytes:
        """A byte-level token's bytes, as the ByteLevel decoder gives them. Cached per id: the
        lookup and the byte map cost ~6 us a token, per stream and step (bench/stream_outputs.py)."""
        cache = self._token_bytes[skip_special_tokens]
        out = cache.get(token_id)
        if out is None:
            out = cache[token_id] = self._uncached_token_bytes(token_id, skip_special_tokens)
        return out

    def _uncached_token_bytes(self, token_id: int, skip_special_tokens: bool) -> bytes:
        token = self.hf.id_to_token(token_id)
        if token is None or (skip_special_tokens and token_id in self.special_ids):
            return b""  # ids past the tokenizer (model vocab padding) have no text either
        # As the ByteLevel decoder does: a token with a character outside the map is raw UTF-8.
        byte_of = self.byte_table
        if all(c in byte_of for c in token):
            return bytes(byte_of[c] for c in token)
        return token.encode()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        # Post-processors of loaded tokenizers may add BOS themselves: we own that choice.
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise InvalidRequest("this model's tokenizer has no chat template; use the completions API")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages must be a non-empty list")
        clean = [_check_message(i, m) for i, m in enumerate(messages)]
        if self._template is None:
            # Sandboxed: a checkpoint's template is data, not trusted code.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=clean, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    # ---- files --------------------------------------------------------------------
    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.hf.save(os.path.join(directory, "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token,
                  "eos_token": self.eos_token, "chat_template": self.chat_template,
                  "model_max_length": None, "add_bos_token": True}
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)

    @classmethod
    def from_directory(cls, directory: str) -> Tokenizer | None:
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(path):
            return None
        config: dict[str, Any] = {}
        config_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path) as f:
                config = json.load(f)
        return cls(HFTokenizer.from_file(path), bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")), chat_template=config.get("chat_template"))


def get_tokenizer(model_name_or_dir: str, cfg: ModelConfig) -> Tokenizer | None:
    """Presets get the built-in tiny tokenizer; a checkpoint directory its own, or None if it has none."""
    if model_name_or_dir in PRESETS:
        return build_tiny_tokenizer(cfg.vocab_size)
    if os.path.isdir(model_name_or_dir):
        return Tokenizer.from_directory(model_name_or_dir)
    raise ConfigError(f"model {model_name_or_dir!r} is neither a preset nor a directory")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Works on bytes: each token's bytes go through an incremental UTF-8 decoder, so a character
    split over several tokens comes out whole once its last byte arrives, never as U+FFFD. For
    tokenizers whose tokens are not byte-level, falls back to re-decoding a short window.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._byte_of = tokenizer.byte_table
        self._ids: list[int] = []
        self._prefix = self._read = 0  # window for the re-decoding fallback

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._byte_of is not None:
            return self._utf8.decode(self.tokenizer.token_bytes(token_id, self.skip_special_tokens))
        return self._redecode()

    def flush(self) -> str:
        """Text held back at the end (an incomplete character becomes U+FFFD)."""
        if self._byte_of is not None:
            return self._utf8.decode(b"", final=True)
        tail = self.tokenizer.decode(self._ids[self._prefix:], self.skip_special_tokens)
        head = self.tokenizer.decode(self._ids[self._prefix:self._read], self.skip_special_tokens)
        self._prefix = self._read = len(self._ids)
        return tail[len(head):]

    def _redecode(self) -> str:
        head = self.tokenizer.decode(self._ids[self._prefix:self._read], self.skip_special_tokens)
        full = self.tokenizer.decode(self._ids[self._prefix:], self.skip_special_tokens)
        if len(full) > len(head) and not full.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return full[len(head):]
        return ""


def _byte_level_table(hf: HFTokenizer) -> dict[str, int] | None:
    """The GPT-2 byte<->unicode map when the tokenizer decodes byte-level, else None."""
    if not isinstance(hf.decoder, decoders.ByteLevel):
        return None
    return {ch: b for b, ch in _bytes_to_unicode().items()}


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible map: printable bytes stand for themselves, the rest shift above 255.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def _check_message(i: int, message: Any) -> dict[str, str]:
    if not isinstance(message, dict):
        raise InvalidRequest(f"messages[{i}] must be an object with 'role' and 'content'")
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        raise InvalidRequest(f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {role!r}")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise InvalidRequest(f"messages[{i}].content: only text parts are supported")
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts")
    return {"role": role, "content": content}


def _token_text(token: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(token, dict):
        return token.get("content")
    return token
