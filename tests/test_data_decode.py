"""Decode and transforms: uint8 batches of the right shape, the PIL fallback, the corrupt-image
policy (skip keeps the batch size and counts; fail names the row), normalisation."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from lance_hpc.data.decode import (
    CorruptImageError,
    Transform,
    decode_batch,
    decode_image,
    normalize,
    random_resized_crop_box,
)
from lance_hpc.data.sources import encode_image, skimage_photo_crops


def photo_bytes(count=4, size=None):
    return [data for data, _ in skimage_photo_crops(count, size=size, min_side=60, max_side=90)]


def rng():
    return np.random.default_rng(0)


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
    batch = decode_batch(images, np.arange(2), np.arange(2), Transform(16), rng()).images
    assert batch.shape == (2, 3, 16, 16) and batch.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("train,augment", [(True, "crop_flip"), (True, "crop"), (True, "none"), (False, "crop_flip")])
def test_batches_are_uint8_squares(train, augment):
    images = pa.array(photo_bytes(5), pa.binary())
    batch = decode_batch(images, np.arange(5), np.arange(5), Transform(32, train=train, augment=augment), rng())
    assert batch.images.shape == (5, 3, 32, 32) and batch.images.dtype == torch.uint8
    assert batch.labels.tolist() == [0, 1, 2, 3, 4] and batch.labels.dtype == torch.int64
    assert batch.skipped == 0


def test_train_transform_is_deterministic_per_generator_and_eval_has_no_randomness():
    images = pa.array(photo_bytes(3), pa.binary())
    first = decode_batch(images, np.zeros(3), np.arange(3), Transform(24), np.random.default_rng(5)).images
    again = decode_batch(images, np.zeros(3), np.arange(3), Transform(24), np.random.default_rng(5)).images
    other = decode_batch(images, np.zeros(3), np.arange(3), Transform(24), np.random.default_rng(6)).images
    assert torch.equal(first, again) and not torch.equal(first, other)
    evaluated = [decode_batch(images, np.zeros(3), np.arange(3), Transform(24, train=False), np.random.default_rng(s)).images for s in (1, 2)]
    assert torch.equal(*evaluated)


def test_without_augmentation_evaluation_sees_what_training_sees():
    images = pa.array(photo_bytes(3), pa.binary())
    trained = decode_batch(images, np.zeros(3), np.arange(3), Transform(24, train=True, augment="none"), rng()).images
    evaluated = decode_batch(images, np.zeros(3), np.arange(3), Transform(24, train=False, augment="none"), rng()).images
    cropped = decode_batch(images, np.zeros(3), np.arange(3), Transform(24, train=False), rng()).images
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
        batch = decode_batch(images, labels, np.array([100, 101, 102, 103, 104]), Transform(16), rng(), dataset="/d.lance")
    assert batch.images.shape == (5, 3, 16, 16) and batch.skipped == 2
    assert set(batch.labels.tolist()) <= {10, 12, 14}
    assert "row 101 of /d.lance" in caplog.text and "row 103" in caplog.text


def test_a_batch_without_any_decodable_image_keeps_its_shape():
    batch = decode_batch(pa.array([b"x", b"y"], pa.binary()), np.array([1, 2]), np.array([7, 8]), Transform(8), rng())
    assert batch.images.shape == (2, 3, 8, 8) and batch.skipped == 2 and int(batch.images.sum()) == 0


def test_fail_names_the_row_and_the_dataset():
    images = pa.array([photo_bytes(1)[0], b"garbage"], pa.binary())
    with pytest.raises(CorruptImageError, match=r"row 42 of s3://b/train.lance.*on_corrupt: skip"):
        decode_batch(images, np.array([0, 1]), np.array([41, 42]), Transform(8), rng(), on_corrupt="fail", dataset="s3://b/train.lance")


def test_large_binary_and_sliced_columns_decode_too():
    data = photo_bytes(4, size=20)
    sliced = pa.array(data, pa.large_binary()).slice(1, 2)
    batch = decode_batch(sliced, np.array([1, 2]), np.array([1, 2]), Transform(8, train=False), rng())
    direct = decode_batch(pa.array(data[1:3], pa.binary()), np.array([1, 2]), np.array([1, 2]), Transform(8, train=False), rng())
    assert torch.equal(batch.images, direct.images)


def test_normalize_uses_imagenet_statistics():
    images = torch.full((2, 3, 4, 4), 255, dtype=torch.uint8)
    out = normalize(images)
    assert out.dtype == torch.float32 and out.shape == images.shape
    assert torch.allclose(out[0, :, 0, 0], torch.tensor([(1 - 0.485) / 0.229, (1 - 0.456) / 0.224, (1 - 0.406) / 0.225]))
