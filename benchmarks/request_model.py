"""What a training job's reads would ask of S3, from the GET requests and bytes per image measured
over the benchmark server: requests/s and MB/s per GPU and for a cluster of GPUs at a stated rate,
set against S3's documented request rate per prefix and its price per GET.

Pure: figures per image in, one row per (strategy, GPUs) out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

IMAGES_PER_S_PER_GPU = 3000.0  # the stated training rate of one GPU
GPU_COUNTS = (1, 8, 64, 512)
# S3's documented rate: "at least 5,500 GET/HEAD requests per second per partitioned prefix".
S3_GETS_PER_S_PER_PREFIX = 5500.0
# S3 Standard: $0.0004 per 1,000 GET requests (us-east-1).
S3_USD_PER_1000_GETS = 0.0004


@dataclass(frozen=True)
class RequestRate:
    """One strategy's reads at ``gpus`` GPUs of ``images_per_s_per_gpu`` each."""

    strategy: str
    gpus: int
    gets_per_image: float
    kb_per_image: float
    gets_per_s: float
    mb_per_s: float
    prefixes: int  # prefixes needed at S3's documented rate per prefix (at least 1)
    usd_per_hour: float  # what the GET requests alone cost per hour (bytes to an EC2 in-region are free)

    @property
    def share_of_one_prefix(self) -> float:
        return self.gets_per_s / S3_GETS_PER_S_PER_PREFIX


def request_rates(
    per_image: Mapping[str, tuple[float, float]],
    images_per_s_per_gpu: float = IMAGES_PER_S_PER_GPU,
    gpus: Sequence[int] = GPU_COUNTS,
    gets_per_s_per_prefix: float = S3_GETS_PER_S_PER_PREFIX,
    usd_per_1000_gets: float = S3_USD_PER_1000_GETS,
) -> list[RequestRate]:
    """For each strategy of ``per_image`` ({strategy: (GET requests per image, KB per image)}) and
    each GPU count: the requests and bytes per second, the prefixes that rate needs, and the GETs'
    cost per hour."""
    found = []
    for strategy, (gets_per_image, kb_per_image) in per_image.items():
        for count in gpus:
            images_per_s = images_per_s_per_gpu * count
            gets_per_s = gets_per_image * images_per_s
            found.append(
                RequestRate(
                    strategy=strategy,
                    gpus=count,
                    gets_per_image=gets_per_image,
                    kb_per_image=kb_per_image,
                    gets_per_s=gets_per_s,
                    mb_per_s=kb_per_image * images_per_s / 1000,
                    prefixes=max(1, math.ceil(gets_per_s / gets_per_s_per_prefix)),
                    usd_per_hour=gets_per_s * 3600 / 1000 * usd_per_1000_gets,
                )
            )
    return found


HEADER = [
    "strategy",
    "GPUs",
    "GET/img",
    "KB/img",
    "GET/s",
    "MB/s",
    "x one prefix's 5,500 GET/s",
    "prefixes needed",
    "GET cost $/hour",
]


def table_rows(rates: Sequence[RequestRate]) -> tuple[list[str], list[list[str]]]:
    """The rates as table cells (``benchmarks.report.format_text`` / ``format_markdown``)."""
    rows = [
        [
            rate.strategy,
            f"{rate.gpus:,}",
            f"{rate.gets_per_image:.3f}",
            f"{rate.kb_per_image:,.1f}",
            f"{rate.gets_per_s:,.0f}",
            f"{rate.mb_per_s:,.0f}",
            f"{rate.share_of_one_prefix:.2f}x",
            f"{rate.prefixes:,}",
            f"{rate.usd_per_hour:,.2f}",
        ]
        for rate in rates
    ]
    return HEADER, rows


def assumptions(images_per_s_per_gpu: float = IMAGES_PER_S_PER_GPU) -> str:
    """The model's stated inputs, one sentence."""
    return (
        f"Request-rate model: {images_per_s_per_gpu:,.0f} images/s per GPU, each strategy's GET requests and KB per image "
        f"as measured over the benchmark server at 25 ms; S3's documented {S3_GETS_PER_S_PER_PREFIX:,.0f} GET/s per "
        f"prefix; S3 Standard's ${S3_USD_PER_1000_GETS} per 1,000 GET (requests only: transfer to compute in the same "
        "region is free). Every GPU reads each of its images from the store once per epoch, as without a node-local "
        "cache (data.cache: once filled, an epoch makes no GET; see the object-storage section)."
    )
