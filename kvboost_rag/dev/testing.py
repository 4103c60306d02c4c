"""Tiny offline models for tests and examples that must not download anything.

``tiny_model(family)`` builds a random-weight causal LM of a given architecture from its
config, and ``tiny_tokenizer()`` trains a small byte-level BPE tokenizer on the Python
reference documents that ship with Python. Both run in a second or two on a CPU.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

from kvboost_rag.corpus import python_reference_documents

TINY_VOCAB_SIZE = 1024

#: Architectures with RoPE that support position-independent reuse, keyed by model_type.
ROPE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi3", "stablelm")

_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(python_reference_documents(), trainer=trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A fast byte-level BPE tokenizer trained on the Python reference docs.

    Args:
        vocab_size: Vocabulary size to train.

    Returns:
        A tokenizer with a ChatML chat template; ``<|im_end|>`` is its EOS token.
    """
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


#: Fields every tiny model shares (GPT-2 names its own).
_COMMON_FIELDS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    # Wide initialization: attention is peaked and each token's output depends strongly
    # on its context, so a wrong or missing cross-document attention shows in the logits.
    "initializer_range": 0.2,
}
#: What each architecture adds to (or, for GPT-2, uses instead of) the common fields.
_FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    "gemma": {"head_dim": 16},
    # Interleaved local (sliding, small window so prompts exceed it) and global layers;
    # Gemma 3 gives each layer type its own RoPE base.
    "gemma2": {
        "head_dim": 16,
        "sliding_window": 48,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    "gemma3_text": {
        "head_dim": 16,
        "sliding_window": 48,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    },
    "qwen3": {"head_dim": 16},
    "stablelm": {"partial_rotary_factor": 0.25},
    "phi3": {"partial_rotary_factor": 0.5},
    "mistral": {"sliding_window": None},
    "gpt2": {
        "n_embd": 64,
        "n_layer": 3,
        "n_head": 4,
        "n_positions": 4096,
    },
}

def tiny_config(family: str, vocab_size: int = TINY_VOCAB_SIZE, **overrides: Any) -> PretrainedConfig:
    """Config of a 3-layer model of the given architecture.

    Args:
        family: A ``model_type`` such as ``"llama"``, ``"qwen3"``, ``"stablelm"``, ``"gpt2"``.
        vocab_size: Vocabulary size (match the tokenizer).
        **overrides: Extra config fields.
    """
    from transformers import AutoConfig

    if family == "gpt2":
        fields = {"vocab_size": vocab_size, "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.2, **_FAMILY_FIELDS["gpt2"]}
    else:
        fields = {**_COMMON_FIELDS, "vocab_size": vocab_size, **_FAMILY_FIELDS.get(family, {})}
    fields.update(overrides)
    return AutoConfig.for_model(family, **fields)


def tiny_model(
    family: str = "llama",
    seed: int = 0,
    vocab_size: int = TINY_VOCAB_SIZE,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> torch.nn.Module:
    """A random-weight causal LM of ``family`` in eval mode (CPU, sdpa attention).

    Weights are drawn in float32 and then cast to ``dtype``, so a bfloat16 or float16 model
    holds the same weights (rounded) as the float32 one of the same seed.
    """
    torch.manual_seed(seed)
    config = tiny_config(family, vocab_size=vocab_size, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(dtype).eval()


def save_tiny_model(folder: str | os.PathLike[str], family: str = "llama") -> str:
    """Save a tiny random model of ``family`` and the tiny tokenizer as a local model folder
    (what ``from_pretrained``/``model_id=`` load); returns the folder as a string."""
    tiny_model(family).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def tiny_engine(family: str = "llama", **settings: Any) -> Any:
    """An engine over :func:`tiny_model` and :func:`tiny_tokenizer` (seed 0): every call builds
    the same model, so processes share its cache namespace. Usable as a warm job's engine
    factory (``kvboost-rag warm ... --engine-factory kvboost_rag.dev.testing:tiny_engine``).

    Args:
        family: A ``model_type`` of :data:`ROPE_FAMILIES` (or ``"gpt2"``).
        **settings: Fields of :class:`~kvboost_rag.config.KVBoostSettings`.
    """
    from kvboost_rag import KVBoost

    return KVBoost.from_model(tiny_model(family), tiny_tokenizer(), **settings)


def record_calls(monkeypatch: Any, target: Any, name: str) -> list[dict[str, Any]]:
    """Record the keyword arguments of every call of ``target.<name>`` (which still runs).

    Args:
        monkeypatch: pytest's ``monkeypatch`` fixture (the method is restored after the test).
        target: The object, e.g. an engine.
        name: The method, e.g. ``"generate"``.

    Returns:
        A list that receives each call's keyword arguments as the calls happen.
    """
    calls: list[dict[str, Any]] = []
    real = getattr(target, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(dict(kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, recording)
    return calls


def refuse_documents(monkeypatch: Any, engine: Any, refusals: dict[str, Exception]) -> list[int]:
    """Make ``engine.warm_documents`` raise for any batch holding a text of ``refusals``.

    Other batches are warmed as usual, so a caller that isolates failures can be checked.

    Args:
        monkeypatch: pytest's ``monkeypatch`` fixture (the method is restored after the test).
        engine: The engine.
        refusals: ``{document text: the error a batch holding it raises}``.

    Returns:
        A list that receives the size of each batch handed to ``warm_documents``.
    """
    sizes: list[int] = []
    real = engine.warm_documents

    def warm_documents(texts: Any, show_progress: Any = None) -> Any:
        texts = list(texts)
        sizes.append(len(texts))
        for text in texts:
            if text in refusals:
                raise refusals[text]
        return real(texts, show_progress=show_progress)

    monkeypatch.setattr(engine, "warm_documents", warm_documents)
    return sizes
