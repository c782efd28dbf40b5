"""Decode and transforms: uint8 batches of the right shape, the PIL fallback, the corrupt-row
policy (skip keeps the batch size and counts; fail names the row), the declared-size limit,
normalisation."""

import struct
import zlib

import numpy as np
import pyarrow as pa
import pytest
import torch
from PIL import ImageFile

from lance_hpc.ingest.image_check import image_size
from lance_hpc.ingest.sources import encode_image, skimage_photo_crops
from lance_hpc.loading.reader import ROW_ID_FIELD, CorruptRowError, apply_corrupt_policy
from lance_hpc.tasks import image_decode as decode_module
from lance_hpc.tasks.base import ROW_ID
from lance_hpc.tasks.image import ImageDecoder
from lance_hpc.tasks.image_decode import (
    MAX_PIXELS,
    Transform,
    binary_values,
    check_declared_size,
    decode_image,
    normalize,
    random_resized_crop_box,
)


def photo_bytes(count=4, size=None):
    return [data for data, _ in skimage_photo_crops(count, size=size, min_side=60, max_side=90)]


def rng():
    return np.random.default_rng(0)


def decode_batch(images, labels, row_ids, transform, generator, *, on_corrupt="skip", dataset=""):
    """What the reader does with one batch: the image decoder into the batch's fields, then the
    corrupt-row policy. Returns (fields, rows replaced)."""
    decoder = ImageDecoder("image", "label", transform)
    table = pa.table({"image": images, "label": pa.array(np.asarray(labels, dtype=np.int64))})
    fields = {**decoder.fields(), ROW_ID: ROW_ID_FIELD}
    out = {name: spec.empty(len(row_ids)) for name, spec in fields.items()}
    out[ROW_ID].copy_(torch.as_tensor(np.asarray(row_ids, dtype=np.int64)))
    bad = decoder.decode(table, out, generator)
    return out, apply_corrupt_policy(out, bad, on_corrupt, dataset)


def test_decode_jpeg_and_png_to_rgb_uint8():
    jpeg = photo_bytes(1)[0]
    image = decode_image(jpeg)
    assert image.dtype == torch.uint8 and image.shape[0] == 3 and 60 <= min(image.shape[1:]) <= 90
    pixels = np.zeros((10, 12, 3), dtype=np.uint8)
    pixels[..., 0] = 200
    png = decode_image(np.frombuffer(encode_image(pixels, "png"), dtype=np.uint8))
    assert png.shape == (3, 10, 12) and int(png[0, 0, 0]) == 200


def test_decode_falls_back_to_pil_for_formats_other_than_jpeg():
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (9, 7), (10, 20, 30)).save(buffer, format="BMP")
    image = decode_image(buffer.getvalue())
    assert image.shape == (3, 7, 9) and image[:, 0, 0].tolist() == [10, 20, 30]


@pytest.mark.parametrize("bad", [b"", b"not an image", b"\xff\xd8\xff" + b"truncated jpeg"])
def test_undecodable_bytes_raise_value_error(bad):
    with pytest.raises(ValueError):
        decode_image(bad)


def test_cmyk_jpeg_that_libjpeg_turbo_refuses_decodes_through_pil():
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("CMYK", (8, 6), (0, 255, 255, 0)).save(buffer, format="JPEG")
    image = decode_image(buffer.getvalue())
    assert image.shape == (3, 6, 8) and image[0, 0, 0] > 200 and image[1, 0, 0] < 60


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torchvision's decoders, deprecated for TorchCodec
def test_decode_matches_torchvision_within_rounding():
    from torchvision.io import decode_jpeg

    for jpeg in photo_bytes(3):
        ours = decode_image(jpeg).int()
        theirs = decode_jpeg(torch.frombuffer(bytearray(jpeg), dtype=torch.uint8)).int()
        assert ours.shape == theirs.shape and (ours - theirs).abs().max() <= 1


@pytest.mark.parametrize("size", [24, 61])
def test_transforms_give_torchvision_pixels(size):
    """Resize, centre crop and random resized crop + flip equal torchvision's v2 functions."""
    import torchvision.transforms.v2.functional as F

    for jpeg in photo_bytes(3):
        image = decode_image(jpeg)
        assert torch.equal(Transform(size, augment="none")(image.permute(1, 2, 0), rng()), F.resize(image, [size, size]))
        short = round(size / 0.875)
        expected = F.center_crop(F.resize(image, [short]), [size, size])
        assert torch.equal(Transform(size, train=False)(image.permute(1, 2, 0), rng()), expected)
        for seed in range(4):
            generator = np.random.default_rng(seed)
            top, left, height, width = random_resized_crop_box(image.shape[1], image.shape[2], generator)
            expected = F.resized_crop(image, top, left, height, width, [size, size])
            if generator.random() < 0.5:
                expected = F.horizontal_flip(expected)
            assert torch.equal(Transform(size)(image.permute(1, 2, 0), np.random.default_rng(seed)), expected)


def test_batches_are_channels_last_so_images_copy_in_without_reordering():
    images = pa.array(photo_bytes(2), pa.binary())
    batch = decode_batch(images, np.arange(2), np.arange(2), Transform(16), rng())[0]["image"]
    assert batch.shape == (2, 3, 16, 16) and batch.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("train,augment", [(True, "crop_flip"), (True, "crop"), (True, "none"), (False, "crop_flip")])
def test_batches_are_uint8_squares(train, augment):
    images = pa.array(photo_bytes(5), pa.binary())
    batch, skipped = decode_batch(images, np.arange(5), np.arange(5), Transform(32, train=train, augment=augment), rng())
    assert batch["image"].shape == (5, 3, 32, 32) and batch["image"].dtype == torch.uint8
    assert batch["label"].tolist() == [0, 1, 2, 3, 4] and batch["label"].dtype == torch.int64
    assert skipped == 0


def images_of(images, transform, generator):
    return decode_batch(images, np.zeros(3), np.arange(3), transform, generator)[0]["image"]


def test_train_transform_is_deterministic_per_generator_and_eval_has_no_randomness():
    images = pa.array(photo_bytes(3), pa.binary())
    first = images_of(images, Transform(24), np.random.default_rng(5))
    again = images_of(images, Transform(24), np.random.default_rng(5))
    other = images_of(images, Transform(24), np.random.default_rng(6))
    assert torch.equal(first, again) and not torch.equal(first, other)
    evaluated = [images_of(images, Transform(24, train=False), np.random.default_rng(s)) for s in (1, 2)]
    assert torch.equal(*evaluated)


def test_without_augmentation_evaluation_sees_what_training_sees():
    images = pa.array(photo_bytes(3), pa.binary())
    trained = images_of(images, Transform(24, train=True, augment="none"), rng())
    evaluated = images_of(images, Transform(24, train=False, augment="none"), rng())
    cropped = images_of(images, Transform(24, train=False), rng())
    assert torch.equal(trained, evaluated) and not torch.equal(evaluated, cropped)


def test_random_resized_crop_box_stays_inside_the_image():
    generator = np.random.default_rng(1)
    for height, width in [(10, 10), (300, 40), (40, 300), (1, 1), (500, 375)]:
        for _ in range(50):
            top, left, crop_height, crop_width = random_resized_crop_box(height, width, generator)
            assert 0 <= top and 0 <= left and 0 < crop_height and 0 < crop_width
            assert top + crop_height <= height and left + crop_width <= width


def test_skip_replaces_corrupt_rows_with_rows_of_the_same_batch_and_counts_them(caplog):
    good = photo_bytes(3)
    images = pa.array([good[0], b"garbage", good[1], None, good[2]], pa.binary())
    labels = np.array([10, 11, 12, 13, 14])
    with caplog.at_level("WARNING", logger="lance_hpc.data"):
        batch, skipped = decode_batch(
            images, labels, np.array([100, 101, 102, 103, 104]), Transform(16), rng(), dataset="/d.lance"
        )
    assert batch["image"].shape == (5, 3, 16, 16) and skipped == 2
    assert set(batch["label"].tolist()) <= {10, 12, 14}
    # A replaced row is a whole good row: its image, its label and the row it came from.
    assert (batch[ROW_ID] - batch["label"]).tolist() == [90] * 5
    for index in (1, 3):
        source = batch[ROW_ID].tolist().index(int(batch[ROW_ID][index]))
        assert source in (0, 2, 4) and torch.equal(batch["image"][index], batch["image"][source])
    assert "row 101 of /d.lance" in caplog.text and "row 103" in caplog.text


def test_a_batch_without_any_decodable_image_keeps_its_shape():
    batch, skipped = decode_batch(pa.array([b"x", b"y"], pa.binary()), np.array([1, 2]), np.array([7, 8]), Transform(8), rng())
    assert batch["image"].shape == (2, 3, 8, 8) and skipped == 2 and int(batch["image"].sum()) == 0


def test_fail_names_the_row_and_the_dataset():
    images = pa.array([photo_bytes(1)[0], b"garbage"], pa.binary())
    with pytest.raises(CorruptRowError, match=r"row 42 of s3://b/train.lance.*on_corrupt: skip"):
        decode_batch(
            images, np.array([0, 1]), np.array([41, 42]), Transform(8), rng(), on_corrupt="fail", dataset="s3://b/train.lance"
        )


def test_large_binary_and_sliced_columns_decode_too():
    data = photo_bytes(4, size=20)
    sliced = pa.array(data, pa.large_binary()).slice(1, 2)
    batch, _ = decode_batch(sliced, np.array([1, 2]), np.array([1, 2]), Transform(8, train=False), rng())
    direct, _ = decode_batch(
        pa.array(data[1:3], pa.binary()), np.array([1, 2]), np.array([1, 2]), Transform(8, train=False), rng()
    )
    assert torch.equal(batch["image"], direct["image"])
    # The decoder's column view honours an array's offset itself (a table may hand it a slice).
    for got, want in zip(binary_values(sliced), binary_values(pa.array(data[1:3], pa.binary()))):
        assert np.array_equal(got, want)


def test_normalize_uses_imagenet_statistics():
    images = torch.full((2, 3, 4, 4), 255, dtype=torch.uint8)
    out = normalize(images)
    assert out.dtype == torch.float32 and out.shape == images.shape
    assert torch.allclose(out[0, :, 0, 0], torch.tensor([(1 - 0.485) / 0.229, (1 - 0.456) / 0.224, (1 - 0.406) / 0.225]))


def jpeg_declaring(width, height):
    """A real small JPEG whose baseline frame header (SOF0) declares ``width`` x ``height``."""
    jpeg = photo_bytes(1, size=16)[0]
    start = jpeg.index(b"\xff\xc0")
    # marker (2 bytes), segment length (2), sample precision (1), then height and width (2 each)
    return jpeg[: start + 5] + struct.pack(">HH", height, width) + jpeg[start + 9 :]


def png_declaring(width, height):
    """A real small PNG whose IHDR chunk declares ``width`` x ``height`` (its CRC recomputed)."""
    png = encode_image(np.zeros((4, 4, 3), np.uint8), "png")
    start = png.index(b"IHDR")
    header = struct.pack(">II", width, height) + png[start + 12 : start + 17]
    return png[:start] + b"IHDR" + header + struct.pack(">I", zlib.crc32(b"IHDR" + header)) + png[start + 21 :]


@pytest.fixture
def never_decode_oversized(monkeypatch):
    """Makes decoding the pixels of an image over the limit fail the test instead of allocating them."""
    decode_jpeg, load = decode_module.simplejpeg.decode_jpeg, ImageFile.ImageFile.load

    def guarded_decode_jpeg(data, *args, **kwargs):
        height, width = decode_module.simplejpeg.decode_jpeg_header(data)[:2]
        assert width * height <= MAX_PIXELS, f"decoded the pixels of a {width}x{height} image"
        return decode_jpeg(data, *args, **kwargs)

    def guarded_load(image):
        assert image.size[0] * image.size[1] <= MAX_PIXELS, f"decoded the pixels of a {image.size} image"
        return load(image)

    monkeypatch.setattr(decode_module.simplejpeg, "decode_jpeg", guarded_decode_jpeg)
    monkeypatch.setattr(ImageFile.ImageFile, "load", guarded_load)


def test_a_jpeg_declaring_more_pixels_than_the_limit_is_a_corrupt_row_never_decoded(never_decode_oversized, caplog):
    huge = jpeg_declaring(30000, 30000)
    with pytest.raises(ValueError, match=r"declares 30000x30000 pixels \(900,000,000\), over the limit of 89,478,485"):
        decode_image(huge)
    good = photo_bytes(2, size=16)
    images = pa.array([good[0], huge, good[1]], pa.binary())
    with caplog.at_level("WARNING", logger="lance_hpc.data"):
        batch, skipped = decode_batch(images, np.array([0, 1, 2]), np.array([5, 6, 7]), Transform(8), rng(), dataset="/d.lance")
    assert skipped == 1 and batch["image"].shape == (3, 3, 8, 8) and batch[ROW_ID].tolist()[1] in (5, 7)
    assert "skipping corrupt row 6 of /d.lance: the image declares 30000x30000 pixels" in caplog.text
    with pytest.raises(
        CorruptRowError, match=r"cannot decode row 6 of /d.lance: the image declares 30000x30000 .*on_corrupt: skip"
    ):
        decode_batch(images, np.array([0, 1, 2]), np.array([5, 6, 7]), Transform(8), rng(), on_corrupt="fail", dataset="/d.lance")


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_other_formats_have_the_same_limit_below_pils_own_hard_limit(never_decode_oversized):
    # 10000 x 10000 is over the limit but under twice it, where PIL itself only warns and decodes.
    with pytest.raises(ValueError, match="declares 10000x10000 pixels .* over the limit"):
        decode_image(png_declaring(10000, 10000))
    assert decode_image(png_declaring(4, 4)).shape == (3, 4, 4)


@pytest.mark.parametrize("side", [9459, 9460, 10000, 13000])
def test_ingest_keeps_exactly_the_images_training_can_decode(side: int) -> None:
    """One pixel limit: an image over it is skipped at ingest, not stored to fail every epoch's decode."""
    kept = image_size(png_declaring(side, side))
    try:
        check_declared_size(side, side)
        decodable = True
    except ValueError:
        decodable = False
    assert isinstance(kept, tuple) == decodable, f"{side}x{side}: ingest check says {kept!r}, decodable: {decodable}"
