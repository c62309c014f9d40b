"""Image decoding and preprocessing for vision models (Pillow): any file Pillow reads, turned upright by
its EXIF orientation and converted to RGB (palette, alpha, grayscale and CMYK images too), within a pixel
limit; then resized, rescaled and normalised as Hugging Face's image processors do."""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence

import numpy as np

MAX_PIXELS = 50_000_000  # a decoded image larger than this is refused (a small file can decode to gigabytes)
MIN_SIDE = 2


class ImageError(ValueError):
    """Bytes that are not an image the model can take."""


def decode(data: bytes, max_pixels: int = MAX_PIXELS):
    """The RGB ``PIL.Image`` of an image file's bytes; ImageError for anything else."""
    try:
        from PIL import Image, ImageOps
    except ImportError:  # pragma: no cover - a dependency
        raise ImageError("images need Pillow: pip install Pillow") from None
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise ImageError("an image must be the non-empty bytes of an image file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise ImageError(f"the image is {width}x{height} = {width * height} pixels, over the limit of "
                                 f"{max_pixels}; send a smaller image")
            if min(width, height) < MIN_SIDE:
                raise ImageError(f"the image is {width}x{height}; it needs at least {MIN_SIDE} pixels a side")
            image.load()
            image = ImageOps.exif_transpose(image)
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"the image is too large: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for bad files (OSError, SyntaxError, ...)
        raise ImageError(f"not an image Pillow can read ({type(exc).__name__}: {exc})") from None
    return to_rgb(image)


def to_rgb(image):
    """RGB from any mode; transparent pixels become white (as a viewer shows them on a page)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if image.mode == "P":
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode in ("L", "RGB") and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def resize_normalize(image, size: tuple[int, int], mean: Sequence[float], std: Sequence[float],
                     rescale: float = 1 / 255) -> np.ndarray:
    """``image`` resized to ``size`` (width, height) with bilinear filtering, scaled by ``rescale`` and
    normalised per channel: float32 (3, height, width), equal to Hugging Face's PIL image processors."""
    from PIL import Image

    resized = np.asarray(image.resize(size, Image.Resampling.BILINEAR), dtype=np.uint8)
    pixels = (resized.astype(np.float64) * rescale).astype(np.float32)
    pixels = (pixels - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))
