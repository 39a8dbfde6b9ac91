"""A chat request's images, checked before admission so that a bad one is a 400 naming its content part with
nothing queued or billed: each decoded (png, jpeg or webp; corrupt, over QUILT_IMAGE_MAX_BYTES or
QUILT_IMAGE_MAX_PIXELS refused), an http(s) URL fetched only where the deployment allows it (gateway.image_fetch)
and sent on to the engine as a data URL, and each image's prompt tokens counted as the model's processor sizes it
(engine.images, torch-free), so that budget holds and tokens per minute include them."""

import asyncio
import base64
import functools
import io
import logging

from PIL import Image, UnidentifiedImageError

from engine.images import (
    FORMATS,
    Gemma3ImageProcessor,
    ImageError,
    QwenVLImageProcessor,
    checkpoint_image_processor,
    decode_data_url,
)
from gateway.caller import Target
from gateway.errors import invalid
from gateway.hot_settings import hot
from gateway.image_fetch import FetchPolicy, FetchRefused, Resolver, fetch_image, system_resolver
from gateway.openai_request import GenerationRequest
from gateway.prompt_tokens import base_tokenizer

log = logging.getLogger(__name__)

MIME_OF_FORMAT = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


@functools.lru_cache(maxsize=32)
def image_processor(checkpoint_dir: str) -> QwenVLImageProcessor | Gemma3ImageProcessor | None:
    """The base model's image processor; None for a text-only base (or a folder the gateway cannot read: the
    engine, which reads it, answers such a request)."""
    try:
        return checkpoint_image_processor(checkpoint_dir)
    except (OSError, ValueError):
        log.exception("the image processor in %s could not be read", checkpoint_dir)
        return None


def fetch_policy() -> FetchPolicy:
    return FetchPolicy(domains=hot.QUILT_IMAGE_FETCH_DOMAINS, allowed_networks=hot.QUILT_IMAGE_FETCH_ALLOWED_NETWORKS,
                       max_bytes=hot.QUILT_IMAGE_MAX_BYTES, timeout_s=hot.QUILT_IMAGE_FETCH_TIMEOUT_SECONDS,
                       max_redirects=hot.QUILT_IMAGE_FETCH_MAX_REDIRECTS)  # fmt: skip


async def load_images(generation: GenerationRequest, target: Target, *, resolve: Resolver = system_resolver) -> None:
    """Checks every image part of `generation` (in place: a fetched URL becomes the data URL the engine is sent)
    and sets generation.image_tokens and generation.image_text; an ApiError (400) naming the first part at fault. `resolve`: how a fetched
    URL's host name resolves."""
    processor = image_processor(target.checkpoint_dir)
    if processor is None:
        raise invalid(f"The model '{target.name}' does not accept images; send text content only.",
                      param=generation.image_params[0], code="image_input_not_supported")  # fmt: skip
    parts = [part for message in generation.messages if message["content"].__class__ is list
             for part in message["content"] if part["type"] == "image_url"]  # fmt: skip
    tokens = []
    for param, part in zip(generation.image_params, parts, strict=True):
        url = part["image_url"]["url"]
        if not url.startswith("data:"):
            url = part["image_url"]["url"] = await _fetched(url, param, resolve)
        try:
            image = await asyncio.to_thread(decode_data_url, url, max_bytes=hot.QUILT_IMAGE_MAX_BYTES,
                                            max_pixels=hot.QUILT_IMAGE_MAX_PIXELS)  # fmt: skip
            tokens.append(processor.image_tokens(image.image.height, image.image.width))
        except ImageError as error:
            raise invalid(f"Invalid image at {param}: {error}.", param=param, code="invalid_image") from None
    generation.image_tokens = tokens
    tokenizer = base_tokenizer(target.checkpoint_dir)
    generation.image_text = None if tokenizer is None else processor.prompt_text(tokenizer.id_to_token)


async def _fetched(url: str, param: str, resolve: Resolver) -> str:
    """An http(s) image URL's image as a data URL, where this deployment fetches URLs."""
    if not url.startswith(("http://", "https://")):
        raise invalid(f"Invalid image at {param}: the URL must be a data:image/...;base64,... URL.", param=param,
                      code="invalid_image")  # fmt: skip
    if not hot.QUILT_IMAGE_FETCH:
        raise invalid(f"Image URLs are not fetched by this server ({param}); send the image as a data URL "
                      f"(data:image/png;base64,...).", param=param, code="image_url_not_allowed")  # fmt: skip
    try:
        data = await fetch_image(url, fetch_policy(), resolve=resolve)
    except FetchRefused as error:
        raise invalid(f"The image at {param} was not fetched: {error}.", param=param,
                      code="image_url_not_allowed") from None  # fmt: skip
    kind = _format(data)
    if kind is None:
        raise invalid(f"Invalid image at {param}: the fetched file is not a png, jpeg or webp image.", param=param,
                      code="invalid_image")  # fmt: skip
    return f"data:{MIME_OF_FORMAT[kind]};base64,{base64.b64encode(data).decode()}"


def _format(data: bytes) -> str | None:
    """The image format Pillow reads fetched bytes as (the decode that follows checks the rest)."""
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            return image.format
    except (UnidentifiedImageError, OSError):
        return None
