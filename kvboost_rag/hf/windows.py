"""Which attention windows a model's layers apply: the one place the engine reads them.

Two decisions depend on them. Documents can be reused at new positions only while the
whole prompt fits a model-wide sliding window (:attr:`LayerWindows.prompt_window`): beyond
it, a cached token would have seen keys the prompt's attention no longer shows. And rows may
share one plain batch (batched warming) only when every layer attends globally
(:attr:`LayerWindows.all_global`): local layers keep per-layer windows a plain batch ignores.
Interleaved local and global layers (Gemma 2/3) apply their windows inside attention and set
no prompt-wide limit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerWindows:
    """The attention windows of a model's layers.

    Attributes:
        prompt_window: Window every layer applies, bounding the prompt as a whole for
            position-independent reuse; ``None`` when no window bounds it.
        all_global: Every layer attends to every earlier token (no window anywhere).
    """

    prompt_window: int | None
    all_global: bool

    @classmethod
    def of(cls, config) -> LayerWindows:
        """Read them from a model's text config."""
        window = getattr(config, "sliding_window", None) or None
        if getattr(config, "use_sliding_window", True) is False:
            window = None
        layer_types = set(getattr(config, "layer_types", None) or [])
        if "full_attention" in layer_types:
            # Interleaved local/global layers (Gemma 2/3): the local layers' attention applies
            # their window itself; no window bounds the prompt as a whole.
            window = None
        return cls(prompt_window=window, all_global=window is None and layer_types <= {"full_attention"})

    def fits(self, total_tokens: int) -> bool:
        """Whether a prompt plus its new tokens stays within :attr:`prompt_window`."""
        return self.prompt_window is None or total_tokens <= self.prompt_window
