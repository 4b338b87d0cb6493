"""Tests for incremental detokenization and stop-string handling."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tpserve.engine.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer, StopChecker

CORPUS = [
    "héllo wörld 日本語 🙂",
    "the quick brown fox jumps over the lazy dog",
    "日本語のテキストと émojis 🙂🙃 naïve café",
    "Grüße aus Köln, ça va? Привет мир",
]
SPECIALS = ["<|eos|>", "<|pad|>"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """A tiny byte-level BPE; the small vocab leaves many multi-byte chars split across tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 10, trainer)
    return tokenizer


def _stream(detok: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[str]:
    chunks = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    chunks.append(detok.finish())
    return chunks


def _byte_token_ids(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte, via the byte-level alphabet."""
    table = dict(enumerate(_bytes_to_unicode()))
    return [tok.token_to_id(table[b]) for b in text.encode("utf-8")]


def _bytes_to_unicode() -> list[str]:
    # GPT-2's byte->printable-char table, which ByteLevel uses for its initial alphabet.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


@pytest.mark.parametrize("text", CORPUS + ["a", "🙂", " 日本 語 ", "mixed: ü🙂日x"])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_streaming_matches_full_decode(tok: Tokenizer, text: str, step: int) -> None:
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok)
    chunks = _stream(detok, ids, step)
    assert "".join(chunks) == detok.text == tok.decode(ids) == text
    assert not any(c.endswith("\ufffd") for c in chunks)


def test_split_multibyte_character_is_held_back(tok: Tokenizer) -> None:
    ids = _byte_token_ids(tok, "a日🙂")
    assert tok.decode(ids) == "a日🙂"
    detok = IncrementalDetokenizer(tok)
    got = [detok.add([i]) for i in ids]
    # 'a' (1 byte), '日' (3 bytes), '🙂' (4 bytes): text appears only when a char completes.
    assert got == ["a", "", "", "日", "", "", "", "🙂"]
    assert detok.text == "a日🙂"


def test_random_token_sequences_match_full_decode(tok: Tokenizer) -> None:
    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(len(SPECIALS), vocab) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tok)
        assert "".join(_stream(detok, ids)) == tok.decode(ids), ids


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok: Tokenizer, skip: bool) -> None:
    eos, pad = (tok.token_to_id(s) for s in SPECIALS)
    ids = tok.encode("héllo").ids + [pad] + tok.encode(" wörld").ids + [eos]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    text = "".join(_stream(detok, ids))
    assert text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|eos|>" in text) is (not skip)


def test_prompt_context_is_not_emitted(tok: Tokenizer) -> None:
    prompt = tok.encode("the quick brown").ids
    output = tok.encode(" fox 日本語").ids
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(_stream(detok, output)) == " fox 日本語"


def test_context_dependent_leading_space() -> None:
    # SentencePiece-style: a word token decodes without its space at the start of a sequence.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    sp = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    sp.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    assert sp.decode([2]) == "world"
    with_prompt = IncrementalDetokenizer(sp, prompt_ids=[1])
    assert [with_prompt.add([2]), with_prompt.add([3])] == [" world", "!"]
    no_prompt = IncrementalDetokenizer(sp)
    assert "".join(_stream(no_prompt, [1, 2, 3])) == sp.decode([1, 2, 3]) == "Hello world!"


class _CountingTokenizer:
    """Records how many ids each decode call sees, to prove per-call work stays bounded."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.max_len = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.max_len = max(self.max_len, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_call_is_bounded(tok: Tokenizer) -> None:
    ids = tok.encode(" ".join(CORPUS * 30)).ids
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, prompt_ids=ids[:50])  # type: ignore[arg-type]
    assert "".join(_stream(detok, ids)) == tok.decode(ids)
    assert len(ids) > 500
    assert counting.max_len <= 8 + CONTEXT_TOKENS


def test_stop_found_across_token_boundaries(tok: Tokenizer) -> None:
    checker = StopChecker(["STOP", "wörld"])
    ids = _byte_token_ids(tok, "héllo wörld and more")
    detok = IncrementalDetokenizer(tok)
    found = None
    for i in ids:
        before = len(detok.text)
        detok.add([i])
        found = checker.check(detok.text, before)
        if found is not None:
            break
    assert found == len("héllo ")
    assert detok.text == "héllo wörld"


def test_stop_check_earliest_and_window() -> None:
    checker = StopChecker(["xyz", "b", "long stop"])
    assert checker.check("aaa b xyz", 0) == 4
    assert checker.check("aaa xyz b", 6) == 4  # 'xyz' overlaps the window start
    assert checker.check("b" + "." * 20, 15) is None  # old match is outside the window
    assert checker.check("nothing", 0) is None
    assert StopChecker([]).check("anything", 0) is None


def test_safe_prefix_len_holds_back_partial_matches() -> None:
    checker = StopChecker(["STOP", "</end>"])
    assert checker.safe_prefix_len("hello ST") == len("hello ")
    assert checker.safe_prefix_len("hello S") == len("hello ")
    assert checker.safe_prefix_len("hello </en") == len("hello ")
    assert checker.safe_prefix_len("hello") == len("hello")
    assert checker.safe_prefix_len("STO") == 0
    assert checker.safe_prefix_len("") == 0
    assert StopChecker([]).safe_prefix_len("abc") == 3
    # The longest held suffix wins across stop strings.
    assert StopChecker(["ab", "xab!"]).safe_prefix_len("zxab") == 1


# --- byte-fallback tokenizers (SentencePiece style: Llama 2, Mistral, Gemma) ----------------

FALLBACK_TEXTS = ["hello 🙂 日本語 €", "🙂🙃", "日本語のテキスト", "naïve café ünïcödé", "a€b😀c"]


@pytest.fixture(scope="module")
def fallback_tok() -> Tokenizer:
    """Pieces for a few words and CJK characters; everything else becomes ``<0xNN>`` tokens,
    decoded through ByteFallback + Fuse + Strip as Llama 2's tokenizer.json does."""
    from tokenizers import normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "▁hello", "▁café", "日", "本", "a", "b", "c", "h", "e", "l", "o"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o")]
    for a, b in list(merges):
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


@pytest.mark.parametrize("text", FALLBACK_TEXTS)
def test_byte_fallback_streams_whole_characters(fallback_tok: Tokenizer, text: str) -> None:
    ids = fallback_tok.encode(text).ids
    assert any(fallback_tok.id_to_token(i).startswith("<0x") for i in ids)  # really byte tokens
    detok = IncrementalDetokenizer(fallback_tok)
    chunks = [detok.add([i]) for i in ids]
    assert "".join(chunks) + detok.finish() == fallback_tok.decode(ids) == text
    assert not any("\ufffd" in c for c in chunks)


def test_byte_fallback_run_rewritten_by_next_byte(fallback_tok: Tokenizer) -> None:
    # ByteFallback turns a whole run of byte tokens into U+FFFDs while the run is invalid:
    # '日' as bytes decodes fine, but '日' + <0xE6> decodes to four U+FFFD. Text already sent
    # must not be re-sent or garbled, and the next character still arrives whole.
    nichi, hon = list("日".encode()), list("本".encode())
    ids = [3 + b for b in nichi + hon]
    assert fallback_tok.decode(ids[:4]) == "\ufffd" * 4
    detok = IncrementalDetokenizer(fallback_tok, prompt_ids=fallback_tok.encode("hello").ids)
    assert [detok.add([i]) for i in ids] == ["", "", "日", "", "", "本"]


def test_incomplete_character_flushed_at_finish(fallback_tok: Tokenizer) -> None:
    # '語' as three byte tokens, then '€' cut after 2 of its 3 bytes: the tokenizer now decodes
    # the whole 5-byte run as 5 U+FFFD, yet '語' was complete and already sent.
    cut = [3 + 0xE2, 3 + 0x82]
    ids = [3 + b for b in "語".encode()] + cut
    assert fallback_tok.decode(ids) == "\ufffd" * 5
    detok = IncrementalDetokenizer(fallback_tok, prompt_ids=fallback_tok.encode("日本").ids)
    chunks = [detok.add([i]) for i in ids]
    assert chunks == ["", "", "語", "", ""]
    assert detok.finish() == fallback_tok.decode(cut) == "\ufffd\ufffd"
    assert detok.text == "語\ufffd\ufffd"


def test_random_unicode_through_both_tokenizer_kinds(tok: Tokenizer,
                                                     fallback_tok: Tokenizer) -> None:
    rng = random.Random(1)
    alphabet = "ab €£日本語中文한국어🙂🙃😀👍🏽" + "é" * 3
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12)))
        for tokenizer in (tok, fallback_tok):
            ids = tokenizer.encode(text).ids
            detok = IncrementalDetokenizer(tokenizer)
            chunks = [detok.add([i]) for i in ids]
            assert not any("\ufffd" in c for c in chunks), (text, chunks)
            assert "".join(chunks) + detok.finish() == tokenizer.decode(ids)
