"""The package-shipped image sources: deterministic, the promised sizes, labels and class names."""

import io

from PIL import Image

from lance_hpc.ingest.sources import PHOTO_NAMES, skimage_photo_crops, sklearn_digits


def test_photo_crops_are_deterministic_prefix_stable_jpegs_in_the_size_range():
    items = list(skimage_photo_crops(30, seed=3, min_side=300, max_side=400))
    assert len(items) == 30
    assert list(skimage_photo_crops(10, seed=3)) == items[:10]
    assert list(skimage_photo_crops(10, seed=4)) != items[:10]
    for data, label in items:
        image = Image.open(io.BytesIO(data))
        assert image.format == "JPEG" and image.mode == "RGB"
        assert 300 <= min(image.size) <= 400
        assert 0 <= label < len(PHOTO_NAMES)
    assert {label for _, label in items} == set(range(len(PHOTO_NAMES)))


def test_photo_crops_fixed_size_and_class_names():
    source = skimage_photo_crops(5, size=64)
    assert len(source) == 5 and source.class_names == PHOTO_NAMES
    assert all(Image.open(io.BytesIO(data)).size == (64, 64) for data, _ in source)


def test_sklearn_digits_are_rgb_images_with_digit_labels():
    source = sklearn_digits()
    assert len(source) == 1797 and source.class_names == tuple("0123456789")
    items = list(source)
    assert len(items) == 1797
    assert {label for _, label in items} == set(range(10))
    image = Image.open(io.BytesIO(items[0][0]))
    assert image.format == "JPEG" and image.size == (32, 32) and image.mode == "RGB"
    png = next(iter(sklearn_digits(size=16, image_format="png")))[0]
    assert Image.open(io.BytesIO(png)).format == "PNG"


def test_sources_have_random_access_equal_to_iteration():
    source = skimage_photo_crops(6, seed=1, size=48)
    assert [source[index] for index in (5, 2)] == [list(source)[5], list(source)[2]]
    digits = sklearn_digits()
    assert digits[100] == list(digits)[100]
