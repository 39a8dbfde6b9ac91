"""Qwen3-VL (dense), mirroring transformers' Qwen3VLForConditionalGeneration: Qwen2.5-VL's shape over the Qwen3
decoder (per-head q/k norms, no q/k/v bias) and Qwen3-VL's vision encoder (engine/models/qwen3_vision.py), whose
deepstack features are added to the image tokens after the first decoder layers; its multimodal rope
interleaves the axes (t, h, w, t, h, w, ...) over the first frequencies instead of giving each a block."""

from engine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from engine.models.qwen3_vision import Qwen3VisionTower


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    vision_tower = Qwen3VisionTower
    text_family = {"qk_norm": True}

    def rope_column_axes(self) -> list[int]:
        """Frequency j turns with h when j % 3 == 1 and j < 3 * sections[1], with w when j % 3 == 2 and
        j < 3 * sections[2], with t otherwise."""
        sections = self.spec.mrope_section
        return [j % 3 if j % 3 and j < 3 * sections[j % 3] else 0 for j in range(sum(sections))]
