"""Image decoding and Qwen-VL and Gemma 3 preprocessing against transformers' own PIL processor and load_image: the same
pixel values, bit for bit, and the same patch grid, for pictures of several sizes (scaled up to min_pixels,
down to max_pixels, odd aspect ratios), in png, jpeg and webp, and with Qwen3-VL's patch size and mean/std."""

import base64
import io

import numpy as np
import pytest
from PIL import Image
from transformers.image_utils import load_image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from engine.images import (
    Gemma3ImageProcessor,
    ImageError,
    QwenVLImageProcessor,
    decode_data_url,
    read_processor_config,
)
from tests.engine.pictures import data_url, picture

QWEN25 = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 40}
QWEN3 = {"patch_size": 16, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
         "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 30}}
SIZES = [(57, 41), (200, 90), (31, 250), (640, 480), (112, 112)]


@pytest.fixture(scope="module", params=[QWEN25, QWEN3], ids=["qwen2.5-vl", "qwen3-vl"])
def processors(request, tmp_path_factory):
    """transformers' processor and ours, ours read back from the preprocessor_config.json transformers saved."""
    hf = Qwen2VLImageProcessorPil(**request.param)
    directory = tmp_path_factory.mktemp("processor")
    hf.save_pretrained(directory)
    return hf, QwenVLImageProcessor.from_config(read_processor_config(directory))


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_pixels_match_transformers(processors, size, fmt):
    hf, ours = processors
    url = data_url(picture(*size, seed=size[0]), fmt)
    expected = hf(load_image(url), return_tensors="np")
    got = ours(decode_data_url(url))
    assert got.pixels.dtype == np.float32
    assert got.pixels.shape == expected["pixel_values"].shape
    assert np.array_equal(got.pixels, expected["pixel_values"])
    assert list(got.grid_thw) == expected["image_grid_thw"][0].tolist()
    assert got.num_tokens == hf.get_number_of_image_patches(size[1], size[0]) // hf.merge_size**2
    assert ours.num_tokens(size[1], size[0]) == got.num_tokens


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gemma3_pixels_match_transformers(size, tmp_path):
    """Gemma 3's processor (its shipped settings: 896 x 896, bilinear, mean and std 0.5) at a small size."""
    hf = Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                 do_pan_and_scan=False)
    hf.save_pretrained(tmp_path)
    ours = Gemma3ImageProcessor.from_config(read_processor_config(tmp_path), num_tokens=16)
    url = data_url(picture(*size, seed=size[1]), "JPEG")
    expected = hf(load_image(url), return_tensors="np")["pixel_values"]
    got = ours(decode_data_url(url))
    assert got.pixels.dtype == np.float32 and expected.shape == (1, *got.pixels.shape)
    assert np.array_equal(got.pixels, expected[0])
    assert got.num_tokens == 16


def test_gemma3_pan_and_scan_is_refused():
    with pytest.raises(ValueError, match="pan-and-scan"):
        Gemma3ImageProcessor.from_config({"do_pan_and_scan": True}, num_tokens=256)


def test_transparent_and_grey_images_match_transformers(processors):
    hf, ours = processors
    rgba = picture(90, 70, seed=3).convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize((90, 70)))
    for image in (rgba, picture(60, 80, seed=4).convert("L"), picture(60, 80, seed=5).convert("P")):
        url = data_url(image, "PNG")
        assert np.array_equal(ours(decode_data_url(url)).pixels, hf(load_image(url), return_tensors="np")["pixel_values"])


def test_processor_config_layouts(tmp_path):
    """transformers 5's processor_config.json nests the image processor; the older file is flat, with the
    pixel bounds as min_pixels / max_pixels."""
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "processor_config.json").write_text(
        '{"image_processor": {"patch_size": 16, "size": {"shortest_edge": 10, "longest_edge": 20}}}')
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "preprocessor_config.json").write_text('{"min_pixels": 11, "max_pixels": 21}')
    new = QwenVLImageProcessor.from_config(read_processor_config(tmp_path / "new"))
    old = QwenVLImageProcessor.from_config(read_processor_config(tmp_path / "old"))
    assert (new.patch_size, new.min_pixels, new.max_pixels) == (16, 10, 20)
    assert (old.patch_size, old.min_pixels, old.max_pixels) == (14, 11, 21)


def test_same_bytes_same_digest_other_picture_other_digest():
    first, again, other = (decode_data_url(data_url(picture(40, 40, seed=s))) for s in (1, 1, 2))
    assert first.digest == again.digest != other.digest


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png", "only data URLs"),
    ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", "unsupported image type"),
    ("data:image/png,rawbytes", "base64"),
    ("data:image/png;base64,not*base64", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n garbage").decode(), "cannot be decoded"),
    ("data:image/png;base64," + base64.b64encode(b"GIF89a not a png at all").decode(), "not a png, jpeg or webp"),
], ids=["http", "gif-type", "not-base64-flag", "bad-base64", "corrupt-png", "other-format"])
def test_bad_images_are_refused(url, message):
    with pytest.raises(ImageError, match=message):
        decode_data_url(url)


def test_a_gif_labelled_png_is_refused():
    buffer = io.BytesIO()
    picture(20, 20, seed=1).save(buffer, format="GIF")
    with pytest.raises(ImageError, match="not a png, jpeg or webp"):
        decode_data_url("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode())


def test_limits_are_checked_before_decoding():
    url = data_url(picture(300, 200, seed=1))
    with pytest.raises(ImageError, match="300x200 pixels"):
        decode_data_url(url, max_pixels=300 * 200 - 1)
    with pytest.raises(ImageError, match="larger than 100 bytes"):
        decode_data_url(url, max_bytes=100)
    assert decode_data_url(url, max_pixels=300 * 200).image.size == (300, 200)
