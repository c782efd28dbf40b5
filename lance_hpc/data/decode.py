"""Image bytes to batched uint8 tensors: decode, train/eval transforms, and normalisation.

JPEG goes through ``torchvision.io.decode_jpeg`` (about 3x faster than PIL here); other formats
through torchvision's generic decoder, then PIL. Transforms work on uint8 tensors, so batches
cross process boundaries at a quarter of the float size; :func:`normalize` runs on the device.
"""

from __future__ import annotations

import io
import logging
import math
import warnings
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from lance_hpc.errors import UserError

log = logging.getLogger("lance_hpc.data")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
JPEG_MAGIC = b"\xff\xd8\xff"
# torchvision's RandomResizedCrop defaults.
CROP_SCALE = (0.08, 1.0)
CROP_LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))
# Evaluation resizes the short side to image_size / EVAL_CROP_FRACTION, then crops the centre.
EVAL_CROP_FRACTION = 0.875
AUGMENTS = ("crop_flip", "crop", "none")
# torchvision 0.29 warns on every decode call that TorchCodec will take over image decoding; the
# decoders still work and are what this module relies on, so batches do not repeat it.
TORCHVISION_DECODE_NOTICE = "The image decoding and encoding capabilities of TorchVision"


class CorruptImageError(UserError):
    """An image that does not decode, with ``on_corrupt: fail``; the message names the row."""


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 3, H, W] on any device -> float32 normalised with the ImageNet mean and std."""
    mean = torch.tensor(IMAGENET_MEAN, device=images.device, dtype=torch.float32).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD, device=images.device, dtype=torch.float32).view(1, 3, 1, 1) * 255
    return (images.float() - mean) / std


@dataclass(frozen=True)
class Transform:
    """How decoded images become fixed-size squares: ``train`` (augment) or ``eval``."""

    image_size: int
    train: bool = True
    augment: str = "crop_flip"

    def __post_init__(self) -> None:
        if self.augment not in AUGMENTS:
            raise ValueError(f"unknown augment {self.augment!r}: use one of {', '.join(AUGMENTS)}")

    def __call__(self, image: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        import torchvision.transforms.v2.functional as F

        size = self.image_size
        if self.augment == "none":  # evaluation sees the same geometry as training
            return F.resize(image, [size, size], antialias=True)
        if not self.train:
            short = round(size / EVAL_CROP_FRACTION)
            return F.center_crop(F.resize(image, [short], antialias=True), [size, size])
        top, left, height, width = random_resized_crop_box(image.shape[-2], image.shape[-1], rng)
        image = F.resized_crop(image, top, left, height, width, [size, size], antialias=True)
        if self.augment == "crop_flip" and rng.random() < 0.5:
            image = image.flip(-1)
        return image


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


def decode_image(data: torch.Tensor) -> torch.Tensor:
    """Encoded bytes (1-D uint8 tensor) -> RGB uint8 [3, H, W]; raises ValueError if undecodable."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TORCHVISION_DECODE_NOTICE, category=DeprecationWarning)
        return _decode_image(data)


def _decode_image(data: torch.Tensor) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_image as decode_any, decode_jpeg

    if data.numel() == 0:
        raise ValueError("empty image")
    try:
        if bytes(data[:3].tolist()) == JPEG_MAGIC:
            return decode_jpeg(data, mode=ImageReadMode.RGB)
        return decode_any(data, mode=ImageReadMode.RGB)
    except RuntimeError as error:
        first_error = str(error).split(",")[0]
    try:
        from PIL import Image

        with Image.open(io.BytesIO(data.numpy().tobytes())) as image:
            pixels = np.asarray(image.convert("RGB"))
        return torch.from_numpy(pixels.copy()).permute(2, 0, 1)
    except Exception as error:  # PIL raises many types for bad bytes
        raise ValueError(f"{first_error}; PIL: {error}") from None


def _output_batch(count: int, size: int) -> torch.Tensor:
    """The uint8 batch tensor; in a DataLoader worker it is allocated in shared memory, so sending
    it to the main process does not copy it again (what default_collate does for its stack)."""
    shape = (count, 3, size, size)
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=torch.uint8)
    prototype = torch.empty(0, dtype=torch.uint8)
    storage = prototype._typed_storage()._new_shared(count * 3 * size * size, device=prototype.device)
    return prototype.new(storage).resize_(*shape)


def binary_values(column: pa.Array | pa.ChunkedArray) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """One buffer holding every value of a binary column, with start/end offsets and validity."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_large_binary(column.type):
        offset_type = np.int64
    elif pa.types.is_binary(column.type):
        offset_type = np.int32
    else:
        raise TypeError(f"image column has type {column.type}, expected binary")
    _, offsets_buffer, data_buffer = column.buffers()[:3]
    offsets = np.frombuffer(offsets_buffer, dtype=offset_type)[column.offset : column.offset + len(column) + 1]
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    start, stop = int(offsets[0]), int(offsets[-1])
    raw = np.frombuffer(data_buffer, dtype=np.uint8)[start:stop] if data_buffer is not None else np.zeros(0, np.uint8)
    # One copy of the batch's bytes makes them a writable tensor that torchvision can decode from.
    return torch.from_numpy(raw.copy()), (offsets - start).astype(np.int64), valid


@dataclass
class DecodedBatch:
    images: torch.Tensor  # uint8 [B, 3, S, S]
    labels: torch.Tensor  # int64 [B]
    skipped: int  # corrupt rows replaced by another row of the batch


def decode_batch(
    images: pa.Array | pa.ChunkedArray,
    labels: np.ndarray,
    row_ids: np.ndarray,
    transform: Transform,
    rng: np.random.Generator,
    *,
    on_corrupt: str = "skip",
    dataset: str = "",
) -> DecodedBatch:
    """Decode and transform a batch into one uint8 tensor.

    A corrupt image with ``on_corrupt: skip`` is replaced by a good image of the same batch (with
    its label), so the batch keeps its size and every rank its step count; it is logged and counted.
    With ``fail`` it raises :class:`CorruptImageError` naming the row and the dataset.
    """
    size = transform.image_size
    count = len(row_ids)
    values, offsets, valid = binary_values(images)
    out = _output_batch(count, size)
    label_tensor = torch.from_numpy(np.array(labels, dtype=np.int64))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TORCHVISION_DECODE_NOTICE, category=DeprecationWarning)
        bad = _decode_into(out, values, offsets, valid, row_ids, transform, rng, on_corrupt, dataset)
    if bad:
        good = [index for index in range(count) if index not in set(bad)]
        for position, index in enumerate(bad):
            if good:
                source = good[position % len(good)]
                out[index].copy_(out[source])
                label_tensor[index] = label_tensor[source]
            else:
                out[index].zero_()  # a batch with no decodable image keeps its shape
    return DecodedBatch(out, label_tensor, len(bad))


def _decode_into(
    out: torch.Tensor,
    values: torch.Tensor,
    offsets: np.ndarray,
    valid: np.ndarray,
    row_ids: np.ndarray,
    transform: Transform,
    rng: np.random.Generator,
    on_corrupt: str,
    dataset: str,
) -> list[int]:
    """Decode every image into ``out``; returns the positions of corrupt ones (policy ``skip``)."""
    bad = []
    for index in range(len(row_ids)):
        try:
            if not valid[index]:
                raise ValueError("null image")
            out[index].copy_(transform(_decode_image(values[offsets[index] : offsets[index + 1]]), rng))
        except ValueError as error:
            if on_corrupt == "fail":
                raise CorruptImageError(
                    f"cannot decode the image in row {int(row_ids[index])} of {dataset or 'the dataset'}: {error}. "
                    "Fix or delete the row, or set data.on_corrupt: skip to replace such rows and count them."
                ) from None
            log.warning("skipping corrupt image in row %d of %s: %s", int(row_ids[index]), dataset or "the dataset", error)
            bad.append(index)
    return bad
