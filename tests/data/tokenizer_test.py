"""Tokenizers: char round-trip, save/load, a local HF checkpoint checked against transformers."""

from __future__ import annotations

import json

import pytest
import tokenizers
import transformers
from data_fixtures import CORPUS, write_hf_tokenizer_dir
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models

from dora_jax.data import tokenizer_lib
from dora_jax.engine import StopMatcher

ALPHABET = "abcxyz0123456789 \n+=>"


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=40))
def test_char_tokenizer_round_trips_one_token_per_character(text):
    tok = tokenizer_lib.char_tokenizer(ALPHABET)
    ids = tok.encode(text)
    assert ids == [3 + ALPHABET.index(c) for c in text]  # pad, eos, unk come first
    assert tok.decode(ids) == text


def test_char_tokenizer_special_ids_and_unknown_characters():
    tok = tokenizer_lib.char_tokenizer("ab")
    assert (tok.pad_id, tok.eos_id, tok.vocab_size) == (0, 1, 5)
    assert tok.encode("a?b") == [3, 2, 4]
    assert tok.decode([3, tok.eos_id, 4, tok.pad_id]) == "ab"  # specials are dropped
    with pytest.raises(ValueError, match="repeated"):
        tokenizer_lib.char_tokenizer("aba")


def test_saved_char_tokenizer_loads_back_identically(tmp_path):
    tok = tokenizer_lib.char_tokenizer(ALPHABET)
    tok.save(tmp_path)
    loaded = tokenizer_lib.load_tokenizer(tmp_path)
    text = "xyz 12+3=>a\nb"
    assert loaded.encode(text) == tok.encode(text)
    assert (loaded.eos_id, loaded.pad_id, loaded.vocab_size) == (1, 0, tok.vocab_size)


def test_hf_directory_matches_transformers(tmp_path):
    eos = {"__type": "AddedToken", "content": "<|im_end|>", "special": True}
    config = {"eos_token": eos, "pad_token": "<|endoftext|>"}
    directory = write_hf_tokenizer_dir(tmp_path, config)
    ours = tokenizer_lib.load_tokenizer(directory)
    ref = transformers.AutoTokenizer.from_pretrained(str(directory))
    for text in [*CORPUS[:3], "unseen wörds ünïcode 🙂", "<|im_start|>user\nhi<|im_end|>"]:
        ids = ref.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.eos_id == ref.eos_token_id
    assert ours.pad_id == ref.pad_token_id
    assert ours.vocab_size == len(ref)


def test_missing_pad_falls_back_to_eos_and_missing_eos_is_an_error(tmp_path):
    directory = write_hf_tokenizer_dir(tmp_path / "a", {"eos_token": "<|endoftext|>"})
    tok = tokenizer_lib.load_tokenizer(directory)
    assert tok.pad_id == tok.eos_id
    (directory / "tokenizer_config.json").write_text(json.dumps({}))
    with pytest.raises(ValueError, match="eos_token"):
        tokenizer_lib.load_tokenizer(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="eos_token='<nope>'"):
        tokenizer_lib.load_tokenizer(directory)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        tokenizer_lib.load_tokenizer(tmp_path / "empty")


@pytest.mark.parametrize("stop", [["<|eot_id|>"], ["<|endoftext|>", "<|eot_id|>"], "<|eot_id|>"])
def test_eos_ids_add_generation_configs_as_transformers_reads_them(tmp_path, stop):
    """A chat turn that ends with a stop id only generation_config.json lists (Llama-3-Instruct's
    <|eot_id|>) ran on to max_decode_length: the engines got the tokenizer's eos alone."""
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>"}
    directory = write_hf_tokenizer_dir(tmp_path, config)
    assert tokenizer_lib.load_tokenizer(directory).eos_ids == (0,)
    vocab = transformers.AutoTokenizer.from_pretrained(str(directory)).get_vocab()
    ids = vocab[stop] if isinstance(stop, str) else [vocab[t] for t in stop]  # int or list
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    ours = tokenizer_lib.load_tokenizer(directory)
    ref = transformers.GenerationConfig.from_pretrained(str(directory)).eos_token_id
    assert ours.eos_ids[0] == ours.eos_id == 0  # the one demonstrations end with
    assert set(ours.eos_ids) == {ours.eos_id, *([ref] if isinstance(ref, int) else ref)}


def test_bad_generation_config_stop_ids_are_refused(tmp_path):
    directory = write_hf_tokenizer_dir(tmp_path, {"eos_token": "<|endoftext|>"})
    for bad in ("<|eot_id|>", [1.5], 10**6):
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": bad}))
        with pytest.raises(ValueError, match="eos_token_id"):
            tokenizer_lib.load_tokenizer(directory)


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bpe")
    write_hf_tokenizer_dir(directory, {"eos_token": "<|endoftext|>"})
    return tokenizer_lib.load_tokenizer(directory), transformers.AutoTokenizer.from_pretrained(
        str(directory)
    )


# Text the byte-level vocabulary covers in merges, in single bytes (multi-byte characters split
# across tokens) and in special tokens (dropped from the text).
PIECES = st.sampled_from(["the answer", " is ", "</answer>", "é", "ünï", "🙂", "<|im_end|>", "x"])


@settings(max_examples=100, deadline=None)
@given(pieces=st.lists(PIECES, max_size=12))
def test_text_stream_gives_the_text_decode_gives(byte_level, pieces):
    ours, ref = byte_level
    ids = ours.encode("".join(pieces))
    stream = ours.text_stream()
    assert "".join(stream(i) for i in ids) == ref.decode(ids, skip_special_tokens=True)


@settings(max_examples=100, deadline=None)
@given(pieces=st.lists(PIECES, min_size=1, max_size=12), data=st.data())
def test_stop_strings_end_at_the_first_token_whose_decoded_text_contains_one(
    byte_level, pieces, data
):
    """The engine's stop rule on a real byte-level tokenizer, against transformers' decoding of
    every prefix: a multi-byte character split across tokens completes only with its last
    byte, and a stop string may span several tokens."""
    ours, ref = byte_level
    ids = ours.encode("".join(pieces))
    text = ref.decode(ids, skip_special_tokens=True)
    start = data.draw(st.integers(0, max(len(text) - 1, 0)))
    stop = text[start : start + data.draw(st.integers(1, 6))] or "</answer>"
    matcher = StopMatcher(stop_strings=[stop], text_stream=ours.text_stream)
    got = next((n for n, i in enumerate(ids, 1) if matcher.step(i)), None)
    prefixes = (ref.decode(ids[:n], skip_special_tokens=True) for n in range(1, len(ids) + 1))
    assert got == next((n for n, t in enumerate(prefixes, 1) if stop in t), None)


def _byte_fallback_tokenizer() -> tokenizer_lib.Tokenizer:
    """A Llama-2-style vocabulary: sentencepiece pieces with "▁" for spaces, and a byte token
    for every byte, whose runs decode as UTF-8 together (ill-formed runs as U+FFFD)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "a", "b", "▁a", "ab", "</", "answer", ">", "▁▁", "x", "é", "▁é", "\n"]:
        vocab[piece] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab, [], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    tok.add_special_tokens(["<s>", "</s>"])
    return tokenizer_lib.Tokenizer(tok, "</s>")


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 280), max_size=12))
def test_text_stream_never_raises_on_what_a_policy_may_sample(ids):
    """Byte tokens that do not form UTF-8 change text tokenizers' stream already gave out, and it
    raises; raised inside an engine call's results, that lost the call's finished samples. The
    stream goes on (ids past the vocabulary included), and once it is past the ill-formed bytes
    its text is `decode`'s again."""
    tok = _byte_fallback_tokenizer()
    stream = tok.text_stream()
    for token_id in ids:
        stream(token_id)
    tail = tok.encode("ab answer")  # well-formed text after whatever came before
    assert "".join(stream(i) for i in tail).endswith(tok.decode(tail).strip())
