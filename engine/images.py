"""Images for the vision-language families: decoded from `data:` URLs and turned into the pixel arrays their
vision encoders read, exactly as transformers' PIL processors do, with numpy and Pillow only (no torch, no
torchvision).

A data URL is decoded as transformers' `load_image` decodes one (base64, Pillow, EXIF orientation applied,
converted to RGB), from png, jpeg or webp bytes only. The Qwen-VL processor then resizes with Pillow's
filter to a size whose sides are multiples of patch * merge and whose area lies in [min_pixels, max_pixels]
(`smart_resize`), rescales in float64 and casts to float32, normalizes with the float32 mean and std, and cuts
the image into patches ordered merge window by merge window, each patch repeated over the temporal axis."""

import base64
import binascii
import hashlib
import io
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP")
MIME_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp"}


class ImageError(ValueError):
    """An image a request carries that cannot be used: not a data URL, not base64, a format other than png,
    jpeg or webp, corrupt, or over a limit."""


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # RGB, upright
    digest: str  # sha256 of the encoded bytes: the image's identity in cache keys


@dataclass(frozen=True)
class ImageFeatures:
    """One image as its family's vision encoder reads it."""

    pixels: np.ndarray  # Qwen-VL: [patches, channels * temporal_patch * patch * patch]; Gemma 3: [3, H, W]; float32
    grid_thw: tuple[int, int, int]  # Qwen-VL: patches along time, height and width; Gemma 3: (1, H, W)
    num_tokens: int  # placeholder tokens the image takes in the prompt
    digest: str


def decode_data_url(url: str, *, max_bytes: int | None = None, max_pixels: int | None = None) -> DecodedImage:
    """The image of a `data:image/...;base64,` URL; ImageError saying what is wrong otherwise. max_bytes caps the
    decoded bytes, max_pixels the image's area, checked from its header before its pixels are decoded."""
    header, comma, payload = url.partition(",")
    if not header.startswith("data:") or not comma:
        raise ImageError("only data URLs (data:image/png;base64,...) are accepted")
    mime, *params = header[len("data:"):].split(";")
    if mime.lower() not in MIME_TYPES:
        raise ImageError(f"unsupported image type {mime!r}; supported: png, jpeg, webp")
    if "base64" not in params:
        raise ImageError("the image data URL must be base64-encoded (;base64,)")
    if max_bytes is not None and len(payload) * 3 // 4 > max_bytes + 3:
        raise ImageError(f"the image is larger than {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"the image data is not valid base64: {exc}") from None
    if max_bytes is not None and len(data) > max_bytes:
        raise ImageError(f"the image is larger than {max_bytes} bytes")
    return DecodedImage(image=open_image(data, max_pixels=max_pixels), digest=hashlib.sha256(data).hexdigest())


def open_image(data: bytes, *, max_pixels: int | None = None) -> Image.Image:
    """The RGB, upright image of png, jpeg or webp bytes, as transformers' load_image makes it."""
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            width, height = image.size
            if max_pixels is not None and width * height > max_pixels:
                raise ImageError(f"the image has {width}x{height} pixels, more than {max_pixels}")
            image.load()
            return ImageOps.exif_transpose(image).convert("RGB")
    except UnidentifiedImageError:
        raise ImageError("the image is not a png, jpeg or webp file") from None
    except (OSError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageError(f"the image cannot be decoded: {exc}") from None


def read_processor_config(model_dir: str | Path) -> dict:
    """The image processor's settings: transformers 5's processor_config.json ("image_processor") or the older
    preprocessor_config.json."""
    model_dir = Path(model_dir)
    combined = model_dir / "processor_config.json"
    if combined.exists():
        config = json.loads(combined.read_text())
        if "image_processor" in config:
            return config["image_processor"]
    legacy = model_dir / "preprocessor_config.json"
    if legacy.exists():
        return json.loads(legacy.read_text())
    raise ValueError(f"no processor_config.json or preprocessor_config.json with an image processor in {model_dir}")


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen-VL's target size: each side a multiple of `factor`, the area within [min_pixels, max_pixels], the
    aspect ratio kept as closely as those allow (Python's round: halves to even, as the model's processor)."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"the image's aspect ratio {max(height, width) / min(height, width):.0f} is over 200")
    target_h, target_w = round(height / factor) * factor, round(width / factor) * factor
    if target_h * target_w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        target_h = max(factor, math.floor(height / shrink / factor) * factor)
        target_w = max(factor, math.floor(width / shrink / factor) * factor)
    elif target_h * target_w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        target_h, target_w = math.ceil(height * grow / factor) * factor, math.ceil(width * grow / factor) * factor
    return target_h, target_w


@dataclass(frozen=True)
class QwenVLImageProcessor:
    """Qwen2-VL's processor, which Qwen2.5-VL and Qwen3-VL use with their own patch size, mean and std."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    resample: int  # a Pillow filter
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_config(cls, config: dict) -> "QwenVLImageProcessor":
        size = config.get("size") or {}
        if config.get("do_convert_rgb") is False:
            raise ValueError("an image processor with do_convert_rgb off is not supported")
        return cls(
            patch_size=config.get("patch_size", 14),
            temporal_patch_size=config.get("temporal_patch_size", 2),
            merge_size=config.get("merge_size", 2),
            min_pixels=config.get("min_pixels") or size.get("shortest_edge") or 56 * 56,
            max_pixels=config.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280,
            image_mean=tuple(config.get("image_mean", (0.48145466, 0.4578275, 0.40821073))),
            image_std=tuple(config.get("image_std", (0.26862954, 0.26130258, 0.27577711))),
            rescale_factor=config.get("rescale_factor", 1 / 255),
            resample=config.get("resample", Image.Resampling.BICUBIC),
            do_resize=config.get("do_resize", True),
            do_rescale=config.get("do_rescale", True),
            do_normalize=config.get("do_normalize", True),
        )

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        if not self.do_resize:
            return height, width
        return smart_resize(height, width, factor=self.patch_size * self.merge_size, min_pixels=self.min_pixels,
                            max_pixels=self.max_pixels)

    def image_tokens(self, height: int, width: int) -> int:
        return self.num_tokens(height, width)

    def prompt_text(self, id_to_token: Callable[[int], str | None]) -> None:
        """None: the chat template's one placeholder token is repeated for the image's tokens, no text around it."""
        return None

    def num_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens of an image of this size: its patches over merge_size ** 2."""
        target_h, target_w = self.target_size(height, width)
        return (target_h // self.patch_size) * (target_w // self.patch_size) // self.merge_size**2

    def __call__(self, image: DecodedImage) -> ImageFeatures:
        target_h, target_w = self.target_size(image.image.height, image.image.width)
        x = _pixels(image.image, (target_h, target_w) if self.do_resize else None, self)  # [H, W, 3]
        patch, merge, temporal = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = target_h // patch, target_w // patch
        channels = x.shape[-1]
        # [H, W, C] -> [gh/m, m, p, gw/m, m, p, C] -> [gh/m, gw/m, m, m, C, p, p]: merge windows in raster order
        x = x.reshape(grid_h // merge, merge, patch, grid_w // merge, merge, patch, channels)
        x = x.transpose(0, 3, 1, 4, 6, 2, 5)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal, patch, patch))  # the still frame twice
        pixels = np.ascontiguousarray(x, dtype=np.float32).reshape(grid_h * grid_w, channels * temporal * patch * patch)
        return ImageFeatures(pixels=pixels, grid_thw=(1, grid_h, grid_w),
                             num_tokens=grid_h * grid_w // merge**2, digest=image.digest)


@dataclass(frozen=True)
class Gemma3ImageProcessor:
    """Gemma 3's processor without pan-and-scan: every image resized to one size with Pillow's filter, rescaled
    and normalized; it takes the model's mm_tokens_per_image tokens, written in the prompt between its own text
    (`prompt_text`)."""

    height: int
    width: int
    num_tokens: int
    image_token_id: int
    boi_token_id: int  # <start_of_image>: the chat template's placeholder
    eoi_token_id: int  # <end_of_image>
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    resample: int
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_config(cls, config: dict, *, num_tokens: int, image_token_id: int = 262_144, boi_token_id: int = 255_999,
                    eoi_token_id: int = 256_000) -> "Gemma3ImageProcessor":
        if config.get("do_pan_and_scan"):
            raise ValueError("Gemma 3's pan-and-scan (do_pan_and_scan) is not supported")
        if config.get("do_convert_rgb") is False:
            raise ValueError("an image processor with do_convert_rgb off is not supported")
        size = config.get("size") or {"height": 224, "width": 224}
        return cls(height=size["height"], width=size["width"], num_tokens=num_tokens, image_token_id=image_token_id,
                   boi_token_id=boi_token_id, eoi_token_id=eoi_token_id,
                   image_mean=tuple(config.get("image_mean", (0.5, 0.5, 0.5))),
                   image_std=tuple(config.get("image_std", (0.5, 0.5, 0.5))),
                   rescale_factor=config.get("rescale_factor", 1 / 255),
                   resample=config.get("resample", Image.Resampling.BILINEAR),
                   do_resize=config.get("do_resize", True), do_rescale=config.get("do_rescale", True),
                   do_normalize=config.get("do_normalize", True))

    def image_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens of an image of any size: the model's mm_tokens_per_image."""
        return self.num_tokens

    def prompt_text(self, id_to_token: Callable[[int], str | None]) -> tuple[str, str]:
        """(placeholder, expansion): the text the chat template writes for an image and what Gemma3Processor puts
        in its place, "\n\n<start_of_image>" + <image_soft_token> * mm_tokens_per_image + "<end_of_image>\n\n"
        (so an image costs a few tokens more than its soft tokens, as many as the tokenizer makes of that text)."""
        boi, eoi, soft = (id_to_token(t) for t in (self.boi_token_id, self.eoi_token_id, self.image_token_id))
        return boi, f"\n\n{boi}{soft * self.num_tokens}{eoi}\n\n"

    def __call__(self, image: DecodedImage) -> ImageFeatures:
        x = _pixels(image.image, (self.height, self.width) if self.do_resize else None, self)  # [H, W, 3]
        pixels = np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)  # [3, H, W]
        return ImageFeatures(pixels=pixels, grid_thw=(1, *pixels.shape[1:]), num_tokens=self.num_tokens,
                             digest=image.digest)


def _pixels(picture: Image.Image, size: tuple[int, int] | None, settings) -> np.ndarray:
    """[H, W, 3] of a picture resized to size (height, width) with the settings' Pillow filter, rescaled in
    float64 then cast to float32 and normalized with the float32 mean and std, each step as transformers' PIL
    backend takes it when the settings ask for it."""
    if size is not None:
        picture = picture.resize((size[1], size[0]), resample=Image.Resampling(settings.resample))
    x = np.asarray(picture)  # [H, W, 3] uint8
    if settings.do_rescale:
        x = (x.astype(np.float64) * settings.rescale_factor).astype(np.float32)
    if settings.do_normalize:
        x = x.astype(np.float32, copy=False)
        x = (x - np.array(settings.image_mean, dtype=np.float32)) / np.array(settings.image_std, dtype=np.float32)
    return x


@dataclass(frozen=True)
class PromptImage:
    """An image in a prompt: its placeholder tokens are prompt[offset : offset + features.num_tokens]."""

    offset: int
    features: ImageFeatures


def expand_image_tokens(token_ids: list[int], image_token_id: int, images: list[ImageFeatures]) -> list[int]:
    """The prompt with its i-th image placeholder (one token, as a chat template writes it) repeated as many times
    as image i has tokens."""
    if token_ids.count(image_token_id) != len(images):
        raise ValueError(f"the prompt has {token_ids.count(image_token_id)} image placeholders for {len(images)} images")
    expanded, pending = [], iter(images)
    for token in token_ids:
        expanded += [token] * next(pending).num_tokens if token == image_token_id else [token]
    return expanded


def place_images(token_ids: list[int], image_token_id: int, images: list[ImageFeatures]) -> list[PromptImage]:
    """Where each image's placeholder run is in an expanded prompt; ValueError unless the runs, in order, are
    exactly as long as the images' token counts."""
    runs, i = [], 0
    while i < len(token_ids):
        if token_ids[i] == image_token_id:
            start = i
            while i < len(token_ids) and token_ids[i] == image_token_id:
                i += 1
            runs.append((start, i - start))
        else:
            i += 1
    expected = [image.num_tokens for image in images]
    lengths = [length for _, length in runs]
    if sum(lengths) != sum(expected):
        raise ValueError(f"the prompt has {sum(lengths)} image tokens; its images take {sum(expected)}")
    placed, cursor = [], iter(runs)
    offset, left = 0, 0
    for image in images:  # adjacent images share one run
        if left == 0:
            offset, left = next(cursor)
        if image.num_tokens > left:
            raise ValueError(f"an image of {image.num_tokens} tokens does not fit its placeholder run")
        placed.append(PromptImage(offset=offset, features=image))
        offset, left = offset + image.num_tokens, left - image.num_tokens
    if left:
        raise ValueError("the prompt's image placeholder runs do not match its images' token counts")
    return placed


def checkpoint_image_processor(model_dir: str | Path) -> "QwenVLImageProcessor | Gemma3ImageProcessor | None":
    """The image processor of a checkpoint folder whose config.json has a vision tower; None for a text-only
    model. Torch-free: the gateway counts an image's prompt tokens with it (`image_tokens(height, width)`) before
    the engine runs."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if "vision_config" not in config:
        return None
    settings = read_processor_config(model_dir)
    if config.get("model_type") == "gemma3":
        return Gemma3ImageProcessor.from_config(
            settings, num_tokens=config.get("mm_tokens_per_image", 256),
            image_token_id=config.get("image_token_id", config.get("image_token_index", 262_144)),
            boi_token_id=config.get("boi_token_index", 255_999), eoi_token_id=config.get("eoi_token_index", 256_000))
    return QwenVLImageProcessor.from_config(settings)
