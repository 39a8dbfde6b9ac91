"""Gemma 3 with images, mirroring transformers' Gemma3ForConditionalGeneration: the Gemma 3 decoder (engine/
models/gemma.py) over token embeddings in which each image's mm_tokens_per_image placeholder tokens carry the
SigLIP encoder's output (engine/models/siglip.py), average-pooled to a tokens_per_side square grid, normed by a
(1 + w) RMSNorm and projected to the decoder's width. An image's tokens attend to each other both ways, in
every layer (a sliding layer's window still bounds them from below): the step's key_limits let each one see
its image's last token, which the scheduler keeps in the same prefill chunk (Sequence.unsplit).

Both checkpoint layouts load: transformers 5's (`model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*`) and the Hub's (`language_model.model.*`, `vision_tower.vision_model.*`,
`multi_modal_projector.*`). A config's text_config holds only what differs from Gemma3TextConfig's defaults,
which are filled in here."""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from engine.context import Context
from engine.models.gemma import Gemma3ForCausalLM
from engine.models.layers import RMSNorm
from engine.models.siglip import SiglipVisionTower
from engine.models.spec import ModelSpec
from engine.parallel.communicator import Communicator

# a checkpoint name's prefix -> ours, the first that matches
PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."), ("model.vision_tower.vision_model.", "vision_tower."),
            ("model.vision_tower.", "vision_tower."), ("vision_tower.vision_model.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."))
# Gemma3TextConfig's defaults that a checkpoint's text_config may leave out (and what its rope bases default to)
TEXT_DEFAULTS = {"vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                 "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                 "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True,
                 "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}


class MultiModalProjector(nn.Module):
    def __init__(self, vision: dict, hidden_size: int) -> None:
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision["hidden_size"], hidden_size),
                                                       requires_grad=False)
        self.mm_soft_emb_norm = RMSNorm(vision["hidden_size"], vision.get("layer_norm_eps", 1e-6), offset=1.0)
        self.patches_per_side = vision["image_size"] // vision["patch_size"]
        tokens_per_side = int(vision["mm_tokens_per_image"] ** 0.5)
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, patches, vision hidden] -> [N * mm_tokens_per_image, hidden], each image's tokens in raster order."""
        batch, _, width = x.shape
        grid = x.transpose(1, 2).reshape(batch, width, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2).reshape(-1, width).contiguous()
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).to(x.dtype)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    @classmethod
    def read_spec(cls, config: dict) -> ModelSpec:
        text = {**TEXT_DEFAULTS, **(config.get("text_config") or {}), "architectures": config["architectures"]}
        vision = {**config["vision_config"], "mm_tokens_per_image": config.get("mm_tokens_per_image", 256)}
        image_token = config.get("image_token_id", config.get("image_token_index", 262_144))
        return dataclasses.replace(super().read_spec(text), vision=vision, image_token_id=image_token,
                                   bidirectional_images=True)

    def __init__(self, spec: ModelSpec, comm: Communicator | None = None) -> None:
        super().__init__(spec, comm)
        self.vision_tower = SiglipVisionTower(spec.vision)
        self.multi_modal_projector = MultiModalProjector(spec.vision, spec.hidden_size)

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]):
        """Every image of a step in one call: pixels [N * 3, H, W] (each image's [3, H, W] in turn) ->
        [N * mm_tokens_per_image, hidden], image after image, and no deepstack features."""
        _, height, width = grids[0]
        return self.multi_modal_projector(self.vision_tower(pixels.view(-1, 3, height, width))), []

    def forward(self, input_ids: torch.Tensor, ctx: Context) -> torch.Tensor:
        embeds = self.model.embed(input_ids)  # [T, hidden], scaled: an image token's replaces it unscaled
        if ctx.images is not None:
            embeds = embeds.index_put((ctx.images.rows,), ctx.images.embeds.to(embeds.dtype))
        return self.model(input_ids, self.rope_positions(ctx), ctx, embeds=embeds)

    def checkpoint_target(self, name: str) -> tuple[str, str, int | None] | None:
        for prefix, ours in PREFIXES:
            if name.startswith(prefix):
                name = ours + name[len(prefix):]
                break
        if name.startswith("vision_tower.head."):  # SigLIP's pooling head, which Gemma 3 does not use
            return None
        if name.startswith(("vision_tower.", "multi_modal_projector.")):  # loaded as stored
            module_name, _, kind = name.rpartition(".")
            return module_name, kind, None
        return super().checkpoint_target(name)
