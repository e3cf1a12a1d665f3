"""One tokenizer interface for Hugging Face checkpoints and the built-in char-level task.

Everything downstream (prompt pipeline, engine stop tokens, stop strings, reward decoding) needs
the same seven things: `encode`, `decode`, `text_stream`, `eos_id`, `eos_ids`, `pad_id`,
`vocab_size`. Both kinds of tokenizer are real `tokenizers.Tokenizer` objects (the char
vocabulary is a WordLevel model over single characters), so there is a single implementation and
the char tokenizer can be saved as a `tokenizer.json` next to a checkpoint and reloaded by the
same loader as a Hugging Face one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the ids of its end-of-sequence and padding tokens.

    `encode` adds no special tokens unless asked: a chat template already writes any BOS / role
    markers, so adding them again would duplicate them (transformers'
    `apply_chat_template(tokenize=True)` makes the same choice), while a plain format template's
    prompt gets the tokenizer's own (a Llama BOS) as `tokenizer(text)` would give it. `decode`
    drops special tokens, which is what a reward function wants to see.

    `eos_ids` are all the ids generation stops at: `eos_id` (the one appended to demonstrations)
    and any more a checkpoint's generation_config.json lists; a chat model's turn often ends with
    one of those (Llama-3-Instruct: `<|eot_id|>`, while its eos_token is `<|end_of_text|>`).
    """

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        eos_token: str,
        pad_token: str | None = None,
        stop_ids: Iterable[int] = (),
    ):
        self.tok = tok
        self.eos_token = eos_token
        self.pad_token = pad_token or eos_token
        self.eos_id = self._id(self.eos_token, "eos_token")
        self.pad_id = self._id(self.pad_token, "pad_token")
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_ids = tuple(dict.fromkeys([self.eos_id, *stop_ids]))
        for token_id in self.eos_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"generation_config.json: eos_token_id {token_id} is not an id of the "
                    f"tokenizer's {self.vocab_size}-token vocabulary"
                )

    def _id(self, token: str, field: str) -> int:
        token_id = self.tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{field}={token!r} is not in the tokenizer's vocabulary")
        return token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens`: also what the tokenizer's post-processor adds (a Llama BOS),
        as transformers' `tokenizer(text)` does; for text that does not write them itself."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def text_stream(self) -> Callable[[int], str]:
        """A new response's text token by token (the engine's `TextStream`), for stop strings:
        each call takes the next id and returns the text it adds, as `decode` gives it, "" while
        a character's bytes are incomplete (the text of a token that completes a stop string
        and starts a multi-byte character comes with that character's last byte)."""
        return _TextStream(self.tok)

    def save(self, directory: str | Path) -> None:
        """Writes `tokenizer.json` and a minimal `tokenizer_config.json`, which
        `load_tokenizer` reads back."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(directory / "tokenizer.json"))
        config = {"eos_token": self.eos_token, "pad_token": self.pad_token}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


class _TextStream:
    """tokenizers' incremental decoder, made never to raise. A policy may sample byte tokens that
    do not form UTF-8 (in a Llama-2-style byte-fallback vocabulary), which turn text already
    given out into replacement characters; the decoder raises on those, and this stream starts
    over from that token instead. So a malformed response is matched on a best-effort basis, and
    no sample is lost to an exception raised in the middle of an engine call's results."""

    def __init__(self, tok: tokenizers.Tokenizer):
        self.tok = tok
        self.stream = decoders.DecodeStream(skip_special_tokens=True)

    def __call__(self, token_id: int) -> str:
        try:
            return self.stream.step(self.tok, int(token_id)) or ""
        except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception for this
            self.stream = decoders.DecodeStream(skip_special_tokens=True)
            try:
                return self.stream.step(self.tok, int(token_id)) or ""
            except Exception:  # noqa: BLE001 - an id the vocabulary lacks: no text
                return ""


def special_token(value: object, field: str) -> str | None:
    """tokenizer_config.json stores special tokens as strings or serialised AddedToken dicts."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"tokenizer_config.json: {field} must be a string or {{'content': ...}}")


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """Loads `tokenizer.json` and the special tokens of `tokenizer_config.json` from a checkpoint.

    A checkpoint without a pad token pads with EOS (padding is masked out everywhere, so any
    in-vocabulary id works). The stop ids of `generation_config.json` (`eos_token_id`, an int or
    a list), when there is one, join `eos_ids`, as transformers' `generate` stops at them.
    """
    directory = Path(directory)
    tok_file = directory / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {directory}")
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    eos = special_token(config.get("eos_token"), "eos_token")
    if eos is None:
        raise ValueError(f"{config_file}: eos_token is missing; the engine needs a stop token")
    pad = special_token(config.get("pad_token"), "pad_token")
    tok = tokenizers.Tokenizer.from_file(str(tok_file))
    return Tokenizer(tok, eos, pad, _generation_stop_ids(directory / "generation_config.json"))


def _generation_stop_ids(path: Path) -> list[int]:
    stop = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    ids = [] if stop is None else [stop] if isinstance(stop, int) else stop
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {stop!r}")
    return ids


def char_tokenizer(alphabet: str) -> Tokenizer:
    """One token per character of `alphabet`, plus `<pad>`, `<eos>` and `<unk>`.

    Ids: pad 0, eos 1, unk 2, then the alphabet in order. Characters outside the alphabet encode
    to `<unk>` (and so do not round-trip); text over the alphabet round-trips exactly.
    """
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
    specials = [PAD, EOS, UNK]
    vocab = {t: i for i, t in enumerate(specials + list(alphabet))}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    return Tokenizer(tok, EOS, PAD)
