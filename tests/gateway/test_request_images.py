"""An image's prompt tokens counted in the gateway, torch-free, as the model's processor counts them: Qwen-VL's by
the size it resizes the image to (transformers' processor's grid), Gemma 3's a fixed mm_tokens_per_image."""

import json

import numpy as np
import pytest
from transformers import Gemma3ImageProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from engine.images import checkpoint_image_processor
from tests.engine.pictures import picture


def checkpoint(directory, config: dict, processor) -> str:
    (directory / "config.json").write_text(json.dumps(config))
    processor.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("size", [(90, 40), (45, 100), (640, 480), (30, 30)])
def test_qwen_vl_counts_as_transformers_processor_grids(tmp_path, size):
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    model_dir = checkpoint(tmp_path, {"model_type": "qwen2_5_vl", "vision_config": {}}, processor)
    grid = processor([picture(*size, seed=1)], return_tensors="np")["image_grid_thw"][0]
    width, height = size
    assert checkpoint_image_processor(model_dir).image_tokens(height, width) == int(np.prod(grid)) // 4


def test_gemma3_takes_its_fixed_count_and_a_text_only_model_none(tmp_path):
    model_dir = checkpoint(tmp_path, {"model_type": "gemma3", "vision_config": {}, "mm_tokens_per_image": 64},
                           Gemma3ImageProcessor(size={"height": 112, "width": 112}))  # fmt: skip
    assert checkpoint_image_processor(model_dir).image_tokens(480, 640) == 64
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert checkpoint_image_processor(tmp_path) is None
