"""Image decoding and preprocessing for vision models (Pillow): any file Pillow reads, turned upright by
its EXIF orientation and converted to RGB (palette, alpha, grayscale and CMYK images too), within a pixel
limit; then resized, rescaled and normalised as Hugging Face's image processors do."""

from __future__ import annotations

import io
import math
import threading
import warnings
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

MAX_PIXELS = 50_000_000  # a decoded image larger than this is refused (a small file can decode to gigabytes)
MIN_SIDE = 2
MAX_PIXELS_IN_FLIGHT = 2 * MAX_PIXELS  # decoded pixels all threads together may hold (~3 bytes each, or 6 mid-way)
ADMIT_SECONDS = 30.0  # how long a decode waits for others to give pixels back
# Pillow's allocation unit for large images; above glibc's largest mmap threshold (32 MB), so a freed image
# goes back to the system instead of staying in a thread's malloc arena (eight requests left 573 MB behind)
_BLOCK_BYTES = 64 << 20


class ImageError(ValueError):
    """Bytes that are not an image the model can take."""


class ImageBusyError(RuntimeError):
    """The images other requests are decoding fill the process's pixel budget: retry later."""


class PixelBudget:
    """Process-wide admission of decoded image pixels (eight concurrent 7000x7000 images took a server
    from 320 MB to a 1.98 GB peak when each request was only checked alone). ``decode`` takes an image's
    pixels before Pillow decodes it, waiting up to ``timeout`` seconds for room (ImageBusyError then),
    and gives them back when the decoded image is freed."""

    def __init__(self, pixels: int = MAX_PIXELS_IN_FLIGHT, timeout: float = ADMIT_SECONDS):
        self.pixels, self.timeout, self.used = pixels, timeout, 0
        self._room = threading.Condition()

    def take(self, n: int) -> int:
        """Take ``n`` pixels (an image larger than the whole budget takes all of it); returns what was taken."""
        n = min(n, self.pixels)
        with self._room:
            if not self._room.wait_for(lambda: self.used + n <= self.pixels, self.timeout):
                raise ImageBusyError(f"the server is decoding other images ({self.used:,} of {self.pixels:,} "
                                     f"pixels in use) and this one ({n:,} pixels) did not fit within "
                                     f"{self.timeout:g} s; retry later")
            self.used += n
        return n

    def give(self, n: int) -> None:
        with self._room:
            self.used -= n
            self._room.notify_all()


BUDGET = PixelBudget()


def decode(data: bytes, max_pixels: int = MAX_PIXELS):
    """The RGB ``PIL.Image`` of an image file's bytes; ImageError for anything else."""
    try:
        from PIL import Image, ImageOps
    except ImportError:  # pragma: no cover - a dependency
        raise ImageError("images need Pillow: pip install Pillow") from None
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise ImageError("an image must be the non-empty bytes of an image file")
    if Image.core.get_block_size() < _BLOCK_BYTES:
        Image.core.set_block_size(_BLOCK_BYTES)
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
            budget = BUDGET
            taken = budget.take(width * height)
            try:
                image.load()
                ImageOps.exif_transpose(image, in_place=True)  # a copy would double the decoded memory
                image = to_rgb(image)
            except BaseException:
                budget.give(taken)
                raise
            weakref.finalize(image, budget.give, taken)  # back when the caller lets go of the image
    except (ImageError, ImageBusyError):
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"the image is too large: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for bad files (OSError, SyntaxError, ...)
        raise ImageError(f"not an image Pillow can read ({type(exc).__name__}: {exc})") from None
    return image


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
                     rescale: float = 1 / 255, bicubic: bool = False) -> np.ndarray:
    """``image`` resized to ``size`` (width, height) with bilinear (or bicubic) filtering, scaled by
    ``rescale`` and normalised per channel: float32 (3, height, width), equal to Hugging Face's PIL
    image processors."""
    from PIL import Image

    filter_ = Image.Resampling.BICUBIC if bicubic else Image.Resampling.BILINEAR
    resized = np.asarray(image.resize(size, filter_), dtype=np.uint8)
    pixels = (resized.astype(np.float64) * rescale).astype(np.float32)
    pixels = (pixels - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def image_bytes(item: Any, where: str = "image") -> bytes:
    """An image given as file bytes, base64 text (Ollama), a ``data:`` URL (OpenAI) or a local path
    (``pathlib.Path`` only); remote URLs are refused: pyggml never fetches them on a caller's behalf."""
    import base64
    import binascii
    import os

    if isinstance(item, (bytes, bytearray)):
        data = bytes(item)
    elif isinstance(item, os.PathLike):
        data = Path(item).read_bytes()
    elif isinstance(item, str):
        text = item.strip()
        if text.lower().startswith(("http://", "https://", "ftp://", "file:")):
            raise ImageError(f"{where}: remote image URLs are not fetched; send the image itself "
                             "(base64, or a data: URL)")
        if text.lower().startswith("data:"):
            header, _, text = text.partition(",")
            if ";base64" not in header.lower():
                raise ImageError(f"{where}: a data: URL must be base64-encoded (data:image/png;base64,...)")
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError(f"{where}: not base64 image data") from None
    else:
        raise ImageError(f"{where}: an image must be bytes, base64 text or a data: URL, got {type(item).__name__}")
    if not data:
        raise ImageError(f"{where}: empty image")
    return data


def split_chat_images(messages: Sequence[Any]) -> tuple[list[Any], list[bytes]]:
    """Messages with their images replaced by ``[img-N]`` markers in the text, and the images in order.
    Images come as a message's ``images`` list (Ollama: put before its text) or as content parts
    ``{"type": "image_url", "image_url": {"url": "data:..."}}`` (OpenAI) or ``{"type": "image", "image": ...}``."""
    out, images = [], []

    def marker(item: Any, where: str) -> str:
        images.append(image_bytes(item, where))
        return f"[img-{len(images) - 1}]"

    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            out.append(message)
            continue
        message = dict(message)
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                where = f"messages[{i}].content[{j}]"
                if kind == "image_url":
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, Mapping) else url
                    if not isinstance(url, str):
                        raise ImageError(f"{where}: image_url needs a url")
                    parts.append({"type": "text", "text": marker(url, where)})
                elif kind == "image":
                    parts.append({"type": "text", "text": marker(part.get("image"), where)})
                else:
                    parts.append(part)
            message["content"] = parts
        extra = message.pop("images", None) or []
        if isinstance(extra, (str, bytes)) or not isinstance(extra, Sequence):
            raise ImageError(f"messages[{i}].images must be a list")
        if extra:
            markers = "".join(marker(x, f"messages[{i}].images[{k}]") for k, x in enumerate(extra))
            if isinstance(message.get("content"), list):
                message["content"] = [{"type": "text", "text": markers}, *message["content"]]
            else:
                message["content"] = markers + (message.get("content") or "")
        out.append(message)
    return out, images


def tile_ratios(max_tiles: int) -> list[tuple[int, int]]:
    """The tile grids (rows, columns) an image may be cut into, in the order whose 1-based index is
    Llama 3.2 Vision's aspect-ratio id."""
    return [(a, b) for a in range(1, max_tiles + 1) for b in range(1, max_tiles + 1) if a * b <= max_tiles]


def _canvas(height: int, width: int, max_tiles: int, tile: int) -> tuple[int, int]:
    """The tile grid (rows, columns) whose canvas needs the least upscaling (else the least
    downscaling) to hold the image, the smaller canvas on a tie (Hugging Face's
    ``get_optimal_tiled_canvas``)."""
    grids = np.array(tile_ratios(max_tiles))
    canvases = grids * tile
    scales = np.minimum(canvases[:, 0] / height, canvases[:, 1] / width)
    up = scales[scales >= 1]
    chosen = np.min(up) if len(up) else np.max(scales[scales < 1])
    candidates = np.flatnonzero(scales == chosen)
    best = candidates[np.argmin(canvases[candidates, 0] * canvases[candidates, 1])]
    return int(grids[best][0]), int(grids[best][1])


def tiles(image, tile: int, max_tiles: int, mean: Sequence[float], std: Sequence[float],
          rescale: float = 1 / 255) -> tuple[np.ndarray, int, int]:
    """Llama 3.2 Vision's preprocessing (Hugging Face's MllamaImageProcessor): the image resized with
    its aspect ratio kept to fit the best grid of ``tile``-pixel tiles (at most ``max_tiles``), padded
    with black at the right and bottom, rescaled, normalised and cut into tiles. Returns float32
    pixels (max_tiles, 3, tile, tile) (unused tiles zero), the aspect-ratio id (1-based index into
    ``tile_ratios``) and the number of tiles used."""
    from PIL import Image

    width, height = image.size
    rows, cols = _canvas(height, width, max_tiles, tile)
    canvas_h, canvas_w = rows * tile, cols * tile
    target_w, target_h = min(max(width, tile), canvas_w), min(max(height, tile), canvas_h)
    scale_h, scale_w = target_h / height, target_w / width
    if scale_w < scale_h:
        new_w, new_h = target_w, min(math.floor(height * scale_w) or 1, target_h)
    else:
        new_h, new_w = target_h, min(math.floor(width * scale_h) or 1, target_w)
    resized = np.asarray(image.resize((new_w, new_h), Image.Resampling.BILINEAR), dtype=np.uint8)
    canvas = np.zeros((canvas_h, canvas_w, 3), np.uint8)
    canvas[:new_h, :new_w] = resized
    pixels = (canvas.astype(np.float64) * rescale).astype(np.float32)
    pixels = ((pixels - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)).transpose(2, 0, 1)
    grid = pixels.reshape(3, rows, tile, cols, tile).transpose(1, 3, 0, 2, 4).reshape(rows * cols, 3, tile, tile)
    out = np.zeros((max_tiles, 3, tile, tile), np.float32)
    out[:rows * cols] = grid
    return out, tile_ratios(max_tiles).index((rows, cols)) + 1, rows * cols
