"""Qwen2.5-VL, mirroring transformers' Qwen2_5_VLForConditionalGeneration: the Qwen2 decoder over token
embeddings in which each image's placeholder tokens carry the vision encoder's output (engine/models/
qwen_vision.py), and a multimodal rope: the head's frequencies split in mrope_section parts, rotated by a
token's temporal, row and column positions. A text token's three positions are equal; an image's tokens are
at (start, start + row, start + column) of its merged patch grid, and the text after it starts at
start + max(rows, columns).

Both checkpoint layouts load: transformers 5's (`model.language_model.*`, `model.visual.*`) and the Hub's
older one (`model.*`, `visual.*`); `language_model.model.*` is read as well."""

import dataclasses

import torch

from engine.context import Context
from engine.images import PromptImage
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen import qwen_layer_types
from engine.models.qwen_vision import QwenVisionTower
from engine.models.spec import ModelSpec
from engine.parallel.communicator import Communicator

# a checkpoint name's prefix -> ours
PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."), ("model.visual.", "visual."))


def text_config(config: dict) -> dict:
    """The language model's config: transformers 5 nests it in text_config, older configs hold it at the top."""
    text = {**config, **(config.get("text_config") or {}), "architectures": config["architectures"]}
    params = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"unsupported rope_type {rope_type!r} for a multimodal rope; supported: default")
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": params.get("rope_theta", text.get("rope_theta"))}
    text["mrope_section"] = tuple(params["mrope_section"])
    text.pop("rope_scaling", None)
    return text


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    vision_tower = QwenVisionTower
    text_family = {"qkv_bias": True, "o_bias": False}  # Qwen2's decoder

    @classmethod
    def read_spec(cls, config: dict) -> ModelSpec:
        text = text_config(config)
        return ModelSpec.from_hf_config(text, default_layer_types=qwen_layer_types, **cls.text_family,
                                        mrope_section=text["mrope_section"], vision=config["vision_config"],
                                        image_token_id=config["image_token_id"])

    def __init__(self, spec: ModelSpec, comm: Communicator | None = None) -> None:
        super().__init__(spec, comm)
        self.visual = self.vision_tower(spec.vision)

    def build_rope_cache(self) -> None:
        super().build_rope_cache()
        half = self.cos_sin_cache.shape[1] // 2
        axes = self.rope_column_axes()
        assert len(axes) == half, "mrope_section must cover the rotary half"
        self.rope_axes = torch.tensor(axes + axes)[None, None, :]  # [1, 1, R]: the axis of each rope column

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]):
        """Every image of a step in one call: [image tokens, hidden], image after image, and the deepstack
        features (one such tensor per layer they are added after)."""
        return self.visual(pixels, grids)

    def rope_column_axes(self) -> list[int]:
        """Which position (0: t, 1: h, 2: w) turns each frequency: mrope_section's counts, in turn."""
        return [axis for axis, width in enumerate(self.spec.mrope_section) for _ in range(width)]

    def forward(self, input_ids: torch.Tensor, ctx: Context) -> torch.Tensor:
        embeds = self.model.embed_tokens(input_ids)  # [T, hidden]
        images, deepstack = ctx.images, None
        if images is not None:  # the image tokens' embeddings from the vision encoder (encode_images)
            embeds = embeds.index_put((images.rows,), images.embeds.to(embeds.dtype))
            deepstack = (images.rows, images.deepstack) if images.deepstack else None
        num_tokens = input_ids.shape[0]
        positions = ctx.mrope_positions if ctx.mrope_positions is not None else ctx.positions.expand(3, -1)
        rows = self.cos_sin_cache[positions]  # [3, T, R]
        table = rows.gather(0, self.rope_axes.expand(1, num_tokens, -1).to(rows.device))[0]  # [T, R]
        ctx = dataclasses.replace(ctx, rope_table=table)
        return self.model(input_ids, torch.arange(num_tokens, device=input_ids.device), ctx, embeds=embeds,
                          deepstack=deepstack)

    def checkpoint_target(self, name: str) -> tuple[str, str, int | None] | None:
        for prefix, ours in PREFIXES:
            if name.startswith(prefix):
                name = ours + name[len(prefix):]
                break
        if name.startswith("visual."):  # loaded as stored: no fused projections in the vision tower
            module_name, _, kind = name.rpartition(".")
            return module_name, kind, None
        return super().checkpoint_target(name)

    def prompt_positions(self, num_tokens: int, images: list[PromptImage]) -> tuple[list[list[int]], int]:
        """The (t, h, w) positions of a prompt's tokens, [3][num_tokens], and the offset of every later token's
        position from its index (each of its three positions is index + offset)."""
        merge = self.spec.vision["spatial_merge_size"]
        axes, index, start = ([], [], []), 0, 0
        for image in [*images, None]:
            end = num_tokens if image is None else image.offset
            for axis in axes:
                axis.extend(range(start, start + end - index))
            start += end - index
            if image is None:
                break
            t, h, w = image.features.grid_thw
            h, w = h // merge, w // merge
            axes[0].extend(start + i for i in range(t) for _ in range(h * w))
            axes[1].extend(start + y for _ in range(t) for y in range(h) for _ in range(w))
            axes[2].extend(start + x for _ in range(t) for _ in range(h) for x in range(w))
            start += max(h, w)
            index = image.offset + image.features.num_tokens
        return [list(axis) for axis in axes], start - num_tokens
