"""Image bytes to batched uint8 tensors: decode, train/eval transforms, and normalisation.

JPEG goes through simplejpeg (libjpeg-turbo, straight into an H x W x 3 array); other formats, and
JPEGs it refuses (CMYK, for one), through PIL. The size a header declares is checked against
:data:`~lance_hpc.limits.MAX_PIXELS` before any pixel is decoded: an image over it is a
corrupt row (ingest skips such images by the same limit). Pixels stay in that H x W x 3 layout from decode to batch: resizing keeps it (torch's uint8 antialiased kernel
works on it without repacking) and the batch is allocated the same way, so each image lands in it
with a plain copy. Batches are uint8 ``[B, 3, S, S]`` tensors in channels-last memory: they cross
process boundaries at a quarter of the float size, and :func:`normalize` runs on the device.
Workers never import torchvision.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import simplejpeg
import torch
import torch.nn.functional as nnf

from lance_hpc.limits import MAX_PIXELS
from lance_hpc.tasks.options import AUGMENTS, IMAGENET_MEAN, IMAGENET_STD

JPEG_MAGIC = b"\xff\xd8\xff"
# torchvision's RandomResizedCrop defaults.
CROP_SCALE = (0.08, 1.0)
CROP_LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))
# Evaluation resizes the short side to image_size / EVAL_CROP_FRACTION, then crops the centre.
EVAL_CROP_FRACTION = 0.875


def normalize(images: torch.Tensor, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> torch.Tensor:
    """uint8 [B, C, H, W] on any device -> float32 normalised per channel (``mean`` and ``std`` of
    pixels in [0, 1], one value per channel; ImageNet's by default)."""
    channels = images.shape[1]
    mean_t = torch.tensor(mean, device=images.device, dtype=torch.float32).view(1, channels, 1, 1) * 255
    std_t = torch.tensor(std, device=images.device, dtype=torch.float32).view(1, channels, 1, 1) * 255
    return (images.float() - mean_t) / std_t


# ITU-R BT.601 luma, as PIL's convert("L") weighs red, green and blue.
LUMA = (0.299, 0.587, 0.114)


def to_grey(image: torch.Tensor) -> torch.Tensor:
    """uint8 [3, H, W] -> uint8 [1, H, W] grey levels."""
    red, green, blue = image.float()
    return (red * LUMA[0] + green * LUMA[1] + blue * LUMA[2]).round_().clamp_(0, 255).to(torch.uint8).unsqueeze(0)


@dataclass(frozen=True)
class Transform:
    """How decoded images become fixed-size squares: ``train`` (augment) or ``eval``."""

    image_size: int
    train: bool = True
    augment: str = "crop_flip"

    def __post_init__(self) -> None:
        if self.augment not in AUGMENTS:
            raise ValueError(f"unknown augment {self.augment!r}: use one of {', '.join(AUGMENTS)}")

    def __call__(self, pixels: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        """uint8 [H, W, 3] -> [3, S, S] in channels-last memory; the same pixels as torchvision's
        Resize / CenterCrop / RandomResizedCrop + RandomHorizontalFlip with antialiasing."""
        size = self.image_size
        if self.augment == "none":  # evaluation sees the same geometry as training
            return resize(pixels, size, size)
        height, width = pixels.shape[0], pixels.shape[1]
        if not self.train:
            short = round(size / EVAL_CROP_FRACTION)
            if height <= width:
                height, width = short, int(short * width / height)
            else:
                height, width = int(short * height / width), short
            top, left = int(round((height - size) / 2.0)), int(round((width - size) / 2.0))
            return resize(pixels, height, width)[:, top : top + size, left : left + size]
        top, left, height, width = random_resized_crop_box(height, width, rng)
        image = resize(pixels[top : top + height, left : left + width], size, size)
        if self.augment == "crop_flip" and rng.random() < 0.5:
            image = image.flip(-1)
        return image


def resize(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [H, W, 3] -> [3, height, width], antialiased bilinear (torchvision's Resize), in
    channels-last memory."""
    if not pixels.is_contiguous():  # a crop: rows of the crop, one after the other
        pixels = pixels.contiguous()
    if (pixels.shape[0], pixels.shape[1]) == (height, width):
        return pixels.permute(2, 0, 1)
    # [1, H, W, 3] seen as [1, 3, H, W] has channels-last strides, so interpolate keeps the layout.
    batch = pixels.unsqueeze(0).permute(0, 3, 1, 2)
    return nnf.interpolate(batch, size=(height, width), mode="bilinear", align_corners=False, antialias=True)[0]


def random_resized_crop_box(height: int, width: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """(top, left, height, width) as torchvision's RandomResizedCrop picks it, from ``rng``."""
    area = height * width
    for _ in range(10):
        target_area = area * rng.uniform(*CROP_SCALE)
        ratio = math.exp(rng.uniform(*CROP_LOG_RATIO))
        crop_width = round(math.sqrt(target_area * ratio))
        crop_height = round(math.sqrt(target_area / ratio))
        if 0 < crop_width <= width and 0 < crop_height <= height:
            top = int(rng.integers(0, height - crop_height + 1))
            left = int(rng.integers(0, width - crop_width + 1))
            return top, left, crop_height, crop_width
    ratio = width / height  # fall back to the largest centred crop with a ratio in range
    if ratio < 3 / 4:
        crop_width, crop_height = width, round(width / (3 / 4))
    elif ratio > 4 / 3:
        crop_height, crop_width = height, round(height * (4 / 3))
    else:
        crop_width, crop_height = width, height
    return (height - crop_height) // 2, (width - crop_width) // 2, crop_height, crop_width


def decode_image(data: np.ndarray | bytes) -> torch.Tensor:
    """Encoded bytes -> RGB uint8 [3, H, W] (a view of H x W x 3 memory); ValueError if undecodable."""
    return decode_pixels(data).permute(2, 0, 1)


def decode_pixels(data: np.ndarray | bytes) -> torch.Tensor:
    """Encoded bytes (bytes or a 1-D uint8 array) -> RGB uint8 [H, W, 3]; ValueError if undecodable."""
    if len(data) == 0:
        raise ValueError("empty image")
    jpeg_error = ""
    if bytes(data[:3]) == JPEG_MAGIC:
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError as error:
            jpeg_error = f"{error}; "
        else:
            check_declared_size(width, height)
            try:
                return torch.from_numpy(simplejpeg.decode_jpeg(data, colorspace="RGB"))
            except ValueError as error:  # e.g. CMYK, which PIL converts
                jpeg_error = f"{error}; "
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data if isinstance(data, bytes) else data.data))  # reads the header only
    except Exception as error:  # PIL raises many types for bad bytes
        raise ValueError(f"{jpeg_error}PIL: {error}") from None
    with image:
        check_declared_size(*image.size)
        try:
            pixels = np.array(image.convert("RGB"))
        except Exception as error:
            raise ValueError(f"{jpeg_error}PIL: {error}") from None
    return torch.from_numpy(pixels)


def check_declared_size(width: int, height: int) -> None:
    """ValueError (a corrupt row) when an image's header declares more than MAX_PIXELS, for every
    format: a header of a few bytes can declare gigapixels, and each DataLoader worker would allocate
    them before finding the data missing."""
    if width * height > MAX_PIXELS:
        raise ValueError(
            f"the image declares {width}x{height} pixels ({width * height:,}), over the limit of "
            f"{MAX_PIXELS:,}, so it was not decoded"
        )


def binary_values(column: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One buffer holding every value of a binary column, with start/end offsets and validity."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    offset_type: type[np.signedinteger]
    if pa.types.is_large_binary(column.type):
        offset_type = np.int64
    elif pa.types.is_binary(column.type):
        offset_type = np.int32
    else:
        raise TypeError(f"image column has type {column.type}, expected binary")
    _, offsets_buffer, data_buffer = column.buffers()[:3]
    offsets: np.ndarray = np.frombuffer(offsets_buffer, dtype=offset_type)[column.offset : column.offset + len(column) + 1]
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    start, stop = int(offsets[0]), int(offsets[-1])
    raw = np.frombuffer(data_buffer, dtype=np.uint8)[start:stop] if data_buffer is not None else np.zeros(0, np.uint8)
    return raw, (offsets - start).astype(np.int64), valid
