"""Real pictures drawn in code for the vision-language tests: gradients, shapes and text, never constant
arrays, so that a pixel off by one step anywhere shows; and their data URLs."""

import base64
import io

import numpy as np
from PIL import Image, ImageDraw


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A diagonal colour gradient with a filled ellipse, a rectangle outline, lines and a line of text."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    base = rng.uniform(0, 255, size=3)
    gradient = np.stack([(base[c] + 255 * (xs / width * (c + 1) + ys / height * (2 - c)) / 3) % 256
                         for c in range(3)], axis=-1)
    image = Image.fromarray(gradient.astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x0, y0 = int(rng.integers(0, width // 2)), int(rng.integers(0, height // 2))
        x1, y1 = int(rng.integers(x0 + 2, width)), int(rng.integers(y0 + 2, height))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        draw.ellipse((x0, y0, x1, y1), fill=colour)
        draw.rectangle((width - x1, height - y1, width - x0 - 1, height - y0 - 1), outline=colour[::-1], width=2)
        draw.line((0, y0, width - 1, y1), fill=colour[1:] + colour[:1], width=1)
    draw.text((2, height // 3), f"Quilt {seed}", fill=(255, 255, 255))
    return image


def data_url(image: Image.Image, fmt: str = "PNG", **save) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buffer.getvalue()).decode()
