"""Small real image sources that ship inside packages, for demos, tests and benchmarks.

Each source is an :class:`ImageSource`: iterating it (or indexing it) yields ``(encoded_bytes,
label)`` pairs, and it knows its length and class names, so ingest can write it to Lance without a
download.
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
from PIL import Image

# scikit-image sample photos that ship inside its wheel (no download), in label order. The grey
# ones are stacked to RGB so every image decodes the same way.
PHOTO_NAMES = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "hubble_deep_field",
    "retina",
    "immunohistochemistry",
    "camera",
    "coins",
    "moon",
    "brick",
    "grass",
    "gravel",
)
DIGIT_NAMES = tuple(str(digit) for digit in range(10))
# Aspect ratios (width / height) of the crops: the range of ordinary photos.
CROP_ASPECT_RANGE = (3 / 4, 4 / 3)
# Share of the largest crop of that aspect ratio that fits in the photo (by side).
CROP_SCALE_RANGE = (0.5, 1.0)


@dataclass(frozen=True)
class ImageSource:
    """A finite source of encoded images with integer labels and random access by index."""

    name: str
    class_names: tuple[str, ...]
    length: int
    _item: Callable[[int], tuple[bytes, int]]

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        return self._item(index)

    def __iter__(self) -> Iterator[tuple[bytes, int]]:
        return (self._item(index) for index in range(self.length))

    def __len__(self) -> int:
        return self.length


def encode_image(pixels: np.ndarray | Image.Image, image_format: str = "jpeg", quality: int = 90) -> bytes:
    """Encode an RGB uint8 array (H, W, 3) or PIL image as JPEG or PNG bytes."""
    image = pixels if isinstance(pixels, Image.Image) else Image.fromarray(pixels)
    buffer = io.BytesIO()
    if image_format.lower() in ("jpeg", "jpg"):
        image.convert("RGB").save(buffer, format="JPEG", quality=quality)
    elif image_format.lower() == "png":
        image.convert("RGB").save(buffer, format="PNG")
    else:
        raise ValueError(f"unknown image format {image_format!r}: use jpeg or png")
    return buffer.getvalue()


@functools.cache
def load_photo(name: str) -> Image.Image:
    """One scikit-image sample photo as an RGB PIL image (cached per process)."""
    import skimage.data

    pixels = np.asarray(getattr(skimage.data, name)())
    if pixels.ndim == 2:
        pixels = np.stack([pixels] * 3, axis=-1)
    return Image.fromarray(np.ascontiguousarray(pixels[..., :3]).astype(np.uint8))


def skimage_photo_crops(
    count: int,
    seed: int = 0,
    min_side: int = 300,
    max_side: int = 400,
    quality: int = 90,
    size: int | None = None,
) -> ImageSource:
    """``count`` JPEGs cut at random from scikit-image's sample photos, labelled by photo.

    Each image is a random crop (aspect ratio in 3:4..4:3, 50-100% of the largest such crop by
    side) resized so its short side is in ``[min_side, max_side]``; with ``size`` every image is
    a ``size`` x ``size`` square instead. Labels cycle through :data:`PHOTO_NAMES`, so classes are
    balanced. Image ``i`` depends only on ``(seed, i)``: the same arguments give the same bytes,
    and a shorter source is a prefix of a longer one.
    """
    if count < 0:
        raise ValueError("count must be >= 0")
    if size is None and not 1 <= min_side <= max_side:
        raise ValueError("need 1 <= min_side <= max_side")

    def item(index: int) -> tuple[bytes, int]:
        label = index % len(PHOTO_NAMES)
        photo = load_photo(PHOTO_NAMES[label])
        aspect, scale, x_frac, y_frac, side_frac = np.random.default_rng([seed, index]).random(5)
        aspect = 1.0 if size is not None else CROP_ASPECT_RANGE[0] + aspect * (CROP_ASPECT_RANGE[1] - CROP_ASPECT_RANGE[0])
        scale = CROP_SCALE_RANGE[0] + scale * (CROP_SCALE_RANGE[1] - CROP_SCALE_RANGE[0])
        width, height = photo.size
        crop_width = min(width, height * aspect) * scale
        crop_height = crop_width / aspect
        left = x_frac * (width - crop_width)
        top = y_frac * (height - crop_height)
        if size is not None:
            out_width = out_height = size
        else:
            short = min(min_side + int(side_frac * (max_side - min_side + 1)), max_side)
            if aspect >= 1:
                out_width, out_height = round(short * aspect), short
            else:
                out_width, out_height = short, round(short / aspect)
        box = (left, top, left + crop_width, top + crop_height)
        crop = photo.resize((out_width, out_height), Image.Resampling.BILINEAR, box=box)
        return encode_image(crop, "jpeg", quality), label

    return ImageSource("skimage-photos", PHOTO_NAMES, count, item)


def sklearn_digits(size: int = 32, image_format: str = "jpeg", quality: int = 95) -> ImageSource:
    """scikit-learn's 1,797 handwritten 8x8 digits, upsampled to ``size`` x ``size`` RGB images.

    Encoded as JPEG by default so they take the same decode path as real photos; ``png`` exercises
    the non-JPEG fallback. Labels are the digits 0-9.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (np.asarray(digits.images) * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    targets = np.asarray(digits.target)

    def item(index: int) -> tuple[bytes, int]:
        image = Image.fromarray(images[index]).resize((size, size), Image.Resampling.BILINEAR)
        return encode_image(image, image_format, quality), int(targets[index])

    return ImageSource("sklearn-digits", DIGIT_NAMES, len(targets), item)


SOURCES: dict[str, Callable[..., ImageSource]] = {
    "sklearn-digits": sklearn_digits,
    "skimage-photos": skimage_photo_crops,
}
