"""Small fast tokenizers of the pipelines real models use, trained offline, for the splice tests.

Each is trained on a slice of the Python reference documents with the ``tokenizers`` library
(a second or less), with the normalizer, pre-tokenizer, model and post-processor of a model
family: GPT-2 (byte-level BPE), RoBERTa-style (byte-level with a prefix space), Llama 3 and
Qwen2 (regular-expression split, then bytes), single digits, sentencepiece conversions
(Metaspace with a "▁" prepended at the first word or at every piece, Unigram, the normalizer
form that prepends and replaces), WordPiece, a special token that strips the spaces around it,
a post-processor adding both a BOS and an EOS, and one with no pre-tokenizer (which splicing
must decline).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from transformers import PreTrainedTokenizerFast

from kvboost_rag.corpus import python_reference_documents

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
#: Text the tokenizers learn from: a slice of the reference documents plus a few characters
#: the prompts use (so most are in the vocabulary).
_EXTRA = "café naïve 日本語のテキスト 😀🚀 ½ x² 12345 67890 — “quotes”"


def _corpus() -> list[str]:
    return python_reference_documents()[:24] + [_EXTRA] * 20


def _wrap(backend, bos: bool = True, eos: bool = False) -> PreTrainedTokenizerFast:
    from tokenizers import processors

    if bos:
        single = "<s> $A </s>" if eos else "<s> $A"
        backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", 1), ("</s>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>"
    )


def _byte_bpe(pre_tokenizer, normalizer=None, bos: bool = False, eos: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(_corpus(), trainer=trainer)
    return _wrap(backend, bos, eos)


def _piece_model(model: str, pre_tokenizer, normalizer=None):
    from tokenizers import Tokenizer, decoders, models, trainers

    if model == "unigram":
        backend = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(vocab_size=700, special_tokens=SPECIALS, unk_token="<unk>", show_progress=False)
    else:
        backend = Tokenizer(models.BPE(unk_token="<unk>"))
        trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS, show_progress=False)
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.Metaspace()
    backend.train_from_iterator(_corpus(), trainer=trainer)
    return _wrap(backend)


def _gpt2():
    from tokenizers import pre_tokenizers

    return _byte_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False))


def _prefix_space():
    from tokenizers import pre_tokenizers

    return _byte_bpe(pre_tokenizers.ByteLevel(add_prefix_space=True))


def _bos_and_eos():
    from tokenizers import pre_tokenizers

    return _byte_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), bos=True, eos=True)


def _llama3():
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated")
    return _byte_bpe(pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), bos=True)


def _qwen2():
    from tokenizers import Regex, normalizers, pre_tokenizers

    split = pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated")
    sequence = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return _byte_bpe(sequence, normalizer=normalizers.NFC())


def _digits():
    from tokenizers import pre_tokenizers

    digits = pre_tokenizers.Digits(individual_digits=True)
    return _byte_bpe(pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False)]))


def _metaspace_first():
    from tokenizers import pre_tokenizers

    return _piece_model("bpe", pre_tokenizers.Metaspace(prepend_scheme="first"))


def _metaspace_always_unigram():
    from tokenizers import normalizers, pre_tokenizers

    return _piece_model("unigram", pre_tokenizers.Metaspace(prepend_scheme="always"), normalizers.NFKC())


def _sentencepiece_normalizer():
    from tokenizers import normalizers, pre_tokenizers

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return _piece_model("bpe", pre_tokenizers.Metaspace(prepend_scheme="never"), normalizer)


def _wordpiece():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    backend = Tokenizer(models.WordPiece(unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()])
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.train_from_iterator(
        _corpus(), trainer=trainers.WordPieceTrainer(vocab_size=700, special_tokens=SPECIALS, show_progress=False)
    )
    return _wrap(backend)


def _stripping_special():
    from tokenizers import AddedToken

    tokenizer = _gpt2()
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<doc>", lstrip=True, rstrip=True)]})
    return tokenizer


def _no_pre_tokenizer():
    from tokenizers import normalizers

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return _piece_model("bpe", None, normalizer)


#: Name -> builder of each pipeline the splice tests cover.
TOKENIZERS: dict[str, Callable[[], PreTrainedTokenizerFast]] = {
    "gpt2": _gpt2,
    "prefix-space": _prefix_space,
    "bos-and-eos": _bos_and_eos,
    "llama3": _llama3,
    "qwen2": _qwen2,
    "digits": _digits,
    "metaspace-first": _metaspace_first,
    "metaspace-always-unigram": _metaspace_always_unigram,
    "sentencepiece-normalizer": _sentencepiece_normalizer,
    "wordpiece": _wordpiece,
    "stripping-special": _stripping_special,
    "no-pre-tokenizer": _no_pre_tokenizer,
}


@functools.lru_cache(maxsize=None)
def trained(name: str) -> PreTrainedTokenizerFast:
    """The tokenizer named ``name`` (trained once per process)."""
    return TOKENIZERS[name]()
