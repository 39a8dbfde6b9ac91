"""Chat messages as a model reads them: rendered by its chat template, each image's placeholder repeated for the
tokens the image takes, and the images preprocessed as the model's own processor does. The offline `LLM` API and
the HTTP server render messages here, so both give a model the same tokens for the same messages."""

import json
from collections.abc import Callable
from dataclasses import dataclass

from engine.images import ImageError, ImageFeatures, decode_data_url, expand_image_tokens


class PromptImageError(ImageError):
    """An image part that cannot be used, named by where it is (`param`: "messages.[0].content.[1]", as OpenAI and
    the gateway name it)."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ImagePart:
    param: str  # "messages.[i].content.[j]", as OpenAI names a content part
    url: str


@dataclass(frozen=True)
class ImageInputs:
    """What a model needs to read images: its processor (DecodedImage -> ImageFeatures), its placeholder token, and
    for a model whose processor writes text around each image (Gemma 3) the placeholder text its chat template
    writes and what the processor puts in its place; otherwise the template's one placeholder token is repeated."""

    processor: Callable
    image_token_id: int
    placeholder: str | None = None
    expansion: str | None = None


def image_parts(messages: list[dict]) -> list[ImagePart]:
    """The image_url parts of chat messages, in order."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    image_url = part.get("image_url")
                    url = image_url.get("url") if isinstance(image_url, dict) else image_url
                    found.append(ImagePart(param=f"messages.[{i}].content.[{j}]", url=url))
    return found


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them (Hugging Face's convention): an assistant's tool call arguments as
    objects, not the JSON text OpenAI sends; an image part typed "image" (Gemma 3's template writes its
    placeholder for that type only; Qwen-VL's take either), its image_url kept."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_template_call(c) for c in calls]}
        content = message.get("content")
        if isinstance(content, list) and any(_is_image(part) for part in content):
            message = {**message, "content": [{**part, "type": "image"} if _is_image(part) else part
                                              for part in content]}
        out.append(message)
    return out


def _is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _template_call(call: dict) -> dict:
    function = dict(call["function"])
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except ValueError:
            pass  # the template renders the text as given
    return {**call, "type": "function", "function": function}


def prepare_images(messages: list[dict], vision: ImageInputs | None) -> list[ImageFeatures]:
    """The messages' images decoded and preprocessed, in order; PromptImageError naming the part at fault, or any
    image part where the model takes no images."""
    parts = image_parts(messages)
    if parts and vision is None:
        raise PromptImageError("this model takes no images: send text content only", param=parts[0].param)
    images = []
    for part in parts:
        try:
            images.append(vision.processor(decode_data_url(part.url)))
        except ImageError as error:
            raise PromptImageError(str(error), param=part.param) from None
    return images


def render_chat(tokenizer, messages: list[dict], *, vision: ImageInputs | None,
                tools: list[dict] | None = None) -> tuple[list[int], list[ImageFeatures]]:
    """The token ids of chat messages and their images: the template's text (with `tools`) encoded without
    special tokens added, each image's placeholder expanded as the model's processor does. Template errors propagate as the
    template raises them."""
    images = prepare_images(messages, vision)
    text = tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=True, tools=tools)
    if images and vision.expansion is not None:
        text = text.replace(vision.placeholder, vision.expansion)
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    if images and vision.expansion is None:
        token_ids = expand_image_tokens(token_ids, vision.image_token_id, images)
    return token_ids, images
