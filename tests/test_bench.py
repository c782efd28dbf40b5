"""The loader benchmark: the real thing end to end on tiny data (so it cannot rot), a job spec's
pipeline, and the pieces that judge the results."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from benchmarks.cli import SECTIONS, parser
from benchmarks.datasets import DataSetSpec, prepare
from benchmarks.object_storage import CACHE_LABEL
from benchmarks.report import (
    cache_row,
    cache_target,
    format_markdown,
    object_storage_rows,
    object_storage_targets,
    table_rows,
    targets,
)
from lance_hpc.bench.configs import Measurement, Result
from lance_hpc.bench.runner import Summary, exactly_once, run_rounds
from lance_hpc.cli.bench import main

TINY_LABELS = (
    "decode limit",
    "reference map-style",
    "reference iterable",
    "torchvision ImageFolder",
    "lance_hpc map/distributed",
    "lance_hpc iterable/sharded_batch",
    "lance_hpc iterable/sharded_fragment",
)


def _result(
    label: str,
    rate: float,
    fingerprints: list[str] = (),
    batches: int = 1,
    rank: int = 0,
    cpu_ms: float = 0.0,
    store: dict | None = None,
) -> Result:
    return Result(
        label,
        "photos",
        rate,
        1.0,
        int(rate),
        batches,
        1.0,
        500.0,
        400.0,
        1.0,
        rank=rank,
        fingerprints=list(fingerprints),
        cpu_ms_per_image=cpu_ms,
        store=store or {},
    )


def test_exactly_once_compares_multisets_so_identical_images_still_count():
    single = [_result("one", 1, ["a", "a", "b", "c"])]
    good = [_result("ddp", 1, ["a", "b"], rank=0), _result("ddp", 1, ["a", "c"], rank=1)]
    check = exactly_once(good, single)
    assert check.ok and (check.duplicated, check.missing, check.rows_read) == (0, 0, 4)
    bad = [_result("ddp", 1, ["a", "b"], rank=0), _result("ddp", 1, ["b", "c"], batches=2, rank=1)]
    check = exactly_once(bad, single)
    assert not check.ok and (check.duplicated, check.missing) == (1, 1)
    assert check.steps_per_rank == [2, 3]


def test_table_and_targets_report_ratios_against_the_decode_limit_and_each_peer():
    summaries = [
        Summary(label, "photos", runs=[[_result(label, rate)] for rate in rates])
        for label, rates in [
            ("decode limit", [2000, 2000, 2000]),
            ("reference map-style", [500, 400, 600]),
            ("reference iterable", [300, 300, 300]),
            ("torchvision ImageFolder", [600, 600, 600]),
            ("lance_hpc map/distributed", [1900, 1800, 2100]),
        ]
    ]
    header, rows = table_rows(summaries)
    default = rows[-1]
    assert default[1] == "1,900 (1,800-2,100)"
    assert default[header.index("x decode limit")] == "0.95x"
    assert default[header.index("x ref map")] == "3.80x"
    assert default[header.index("x ImageFolder")] == "3.17x"
    assert "| lance_hpc map/distributed |" in format_markdown(header, rows)
    verdicts = {t.name: t.met for t in targets(summaries, "lance_hpc map/distributed", None, None, ["lance_hpc map/distributed"])}
    assert verdicts["default strategy vs decode limit"] and verdicts["default strategy vs reference map-style"]
    assert verdicts["time to first batch < 3 s"] and verdicts["worker memory flat over the run"]


def test_object_storage_table_bills_gets_and_bytes_per_image_and_judges_the_latency_targets():
    label = "lance_hpc map/distributed"

    def summary(rates: list[float], cpu_ms: float, gets_per_image: float = 0.0) -> Summary:
        return Summary(
            label,
            "photos",
            runs=[
                [
                    _result(
                        label,
                        rate,
                        cpu_ms=cpu_ms,
                        store={
                            "gets": gets_per_image * rate,
                            "get_bytes": 40_000 * rate,
                            "cpu_s": 0.0002 * rate,
                            "max_in_flight": 64,
                        }
                        if gets_per_image
                        else None,
                    )
                ]
                for rate in rates
            ],
        )

    local = {label: summary([1000, 1000], 1.0)}
    grid = {
        label: {0.0: summary([900, 800], 1.05, 1.5), 25.0: summary([880, 860], 1.2, 1.25), 50.0: summary([700, 700], 1.0, 1.0)}
    }
    header, rows = object_storage_rows(local, grid)
    column = {name: index for index, name in enumerate(header)}
    assert [row[column["storage"]] for row in rows] == ["local disk", "S3 0 ms", "S3 25 ms", "S3 50 ms"]
    at_25 = rows[2]
    assert at_25[column["images/s (min-max)"]] == "870 (860-880)"
    assert at_25[column["x local disk"]] == "0.87x" and at_25[column["x 0 ms"]] == "1.02x"
    assert at_25[column["GET/img"]] == "1.25" and at_25[column["KB/img"]] == "40.0"
    assert at_25[column["x local CPU"]] == "1.20x" and at_25[column["server CPU ms/img"]] == "0.20"
    assert at_25[column["in flight (peak)"]] == "64"
    verdicts = {t.name: t for t in object_storage_targets(local, grid, label)}
    assert verdicts["default strategy at 25 ms vs local disk"].met  # 0.87x >= 0.85x
    latency = verdicts["every strategy with latency vs its own 0 ms"]
    assert not latency.met and "0.82x" in latency.detail and "at 50 ms" in latency.detail  # 700 / 850
    cpu = verdicts["loader CPU per image over S3 vs local disk"]
    assert not cpu.met and "1.20x" in cpu.detail


def test_cache_target_wants_local_speed_and_almost_no_gets_from_a_warm_cache():
    label = "lance_hpc map/distributed"

    def summary(rate: float, gets_per_image: float | None) -> Summary:
        store = None if gets_per_image is None else {"gets": gets_per_image * rate, "get_bytes": 0.0, "cpu_s": 0.0}
        return Summary(label, "photos", runs=[[_result(label, rate, cpu_ms=1.0, store=store)]])

    disk, uncached = summary(1000, None), summary(800, 1.05)
    assert cache_target(summary(960, 0.0), disk, uncached).met
    slow = cache_target(summary(900, 0.0), disk, uncached)
    assert not slow.met and "0.90x" in slow.detail
    chatty = cache_target(summary(1000, 0.02), disk, uncached)  # 1.9% of an uncached epoch's GETs
    assert not chatty.met and "1.90%" in chatty.detail
    assert not cache_target(summary(1000, None), disk, uncached).met  # no counters: nothing shows few GETs
    row = cache_row("with cache", "S3 25 ms, 2nd epoch", summary(960, 0.0), disk)
    assert row[:5] == ["with cache", "S3 25 ms, 2nd epoch", "960", "0.96x", "-"] and row[5] == "0.00"


def test_sections_are_chosen_by_name_and_configurations_run_as_often_as_asked(tmp_path, monkeypatch):
    args = parser().parse_args(["--sections", "object_storage,local"])
    assert args.sections == ["local", "object_storage"]  # report order, not the order given
    assert parser().parse_args([]).sections == list(SECTIONS)
    with pytest.raises(SystemExit):
        parser().parse_args(["--sections", "local,disk"])
    help_text = parser().format_help()
    assert all(name in help_text for name in SECTIONS) and "first-byte latency" in help_text

    calls: list[str] = []
    configs = [
        Measurement("a", "decode_limit", "photos"),
        Measurement("b", "decode_limit", "photos"),
        Measurement("a", "decode_limit", "photos-s3-0ms"),
    ]
    runs = {("photos", "a"): 3, ("photos", "b"): 1, ("photos-s3-0ms", "a"): 2}
    from lance_hpc.bench import runner

    monkeypatch.setattr(
        runner,
        "run_measurement",
        lambda config, work_dir, worker: calls.append(f"{config.dataset}/{config.label}") or [_result(config.label, 10.0)],
    )
    summaries = run_rounds(configs, runs, tmp_path, log=lambda line: None)
    assert [len(summary.runs) for summary in summaries] == [3, 1, 2]
    assert calls.count("photos/a") == 3 and calls.count("photos/b") == 1 and calls.count("photos-s3-0ms/a") == 2


def test_data_sets_are_cached_and_identical_specs_are_not_regenerated(tmp_path):
    spec = DataSetSpec("small", count=24, image_size=32, batch_size=8, size=32, rows_per_fragment=10)
    messages: list[str] = []
    first = prepare(spec, tmp_path, log=messages.append)
    second = prepare(spec, tmp_path, log=messages.append)
    assert len(messages) == 1 and first == second
    import lance

    assert lance.dataset(first.lance_uri).count_rows() == 24
    assert sum(1 for _ in (tmp_path / "small-24" / "imagefolder").rglob("*.jpg")) == 24


@pytest.mark.slow
def test_tiny_benchmark_runs_end_to_end_reads_every_row_once_and_bills_the_s3_server(tmp_path, capfd, monkeypatch):
    """Both data sections in one run, as a user would ask for them (through lance-hpc bench, which
    runs the checkout's benchmarks/ in a process of its own): the object storage section shares the
    local section's local-disk rows."""
    monkeypatch.chdir(tmp_path)  # a relative --out, as from a shell: the cache row needs an absolute data.cache.dir
    code = main(["--tiny", "--sections", "local,object_storage", "--out", "out"])
    out = tmp_path / "out"
    printed = capfd.readouterr().out
    assert code == 0, printed
    markdown = (out / "results.md").read_text()
    for label in TINY_LABELS:
        assert f"| {label} |" in markdown, label
        assert label in printed
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "results.json").read_text())
    check = results["exactly_once"]
    assert check["ranks"] == 2 and check["duplicated"] == 0 and check["missing"] == 0
    assert check["rows_read"] == check["rows_expected"] == 384
    assert len(set(check["steps_per_rank"])) == 1
    assert all(summary["images_per_s"] > 0 for summary in results["summaries"])

    assert "## Object storage: small over the S3 protocol" in markdown
    for label in TINY_LABELS[-3:]:
        for storage in ("local disk", "S3 25 ms"):  # --tiny: one latency
            assert f"| {label} | {storage} |" in markdown, (label, storage)
    assert "default strategy at 25 ms vs local disk" in markdown
    assert (out / "object_storage.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    by_key = {(s["dataset"], s["label"]): s for s in results["summaries"]}
    assert len(by_key) == len(TINY_LABELS) + 5  # and the 2-rank DDP check, three strategies over S3, the cache's 2nd epoch
    cached = by_key.pop(("small-s3-25ms", CACHE_LABEL))["runs"][0][0]
    # The epoch after the one that filled the node-local cache: every row, and not one GET of the store.
    assert not cached["error"] and cached["images"] == 384 - 32 and cached["epoch_done"]  # all after the first batch
    assert cached["store"]["gets"] == 0 and cached["store"]["errors"] == 0
    assert f"| {CACHE_LABEL} | S3 25 ms, 2nd epoch |" in markdown
    assert "second epoch from the node-local cache vs local disk" in markdown
    billed = 0
    for (dataset, label), summary in by_key.items():
        result = summary["runs"][0][0]
        assert not result["error"] and result["images"] > 0, (dataset, label)
        if "-s3-" in dataset:  # read through the server, without an error answer
            assert result["store"]["errors"] == 0 and "gets" in result["store"], (dataset, label)
            billed += result["store"]["gets"]
        else:
            assert result["store"] == {}
    # Windows start at the first batch: on 12 batches read-ahead may have fetched a row's whole
    # epoch before it, but not every row's.
    assert billed > 0


@pytest.mark.slow
def test_job_spec_mode_measures_that_jobs_pipeline(tmp_path, capsys):
    data = prepare(
        DataSetSpec("small", count=128, image_size=32, batch_size=16, size=48, rows_per_fragment=50), tmp_path / "data"
    )
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "bench-job",
                "data": {"uri": data.lance_uri, "batch_size": 16, "num_workers": 1},
                "task": {"name": "image_classification", "options": {"image_size": 32}},
            }
        )
    )
    code = main([str(job), "--out", str(tmp_path / "out"), "--runs", "1", "--seconds", "0.5", "--batch-size", "8,16"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "map/distributed workers=1 batch=8" in printed and "map/distributed workers=1 batch=16" in printed
    assert "decode limit" in printed and "first batch s" in printed


def test_job_spec_mode_says_it_measures_image_classification_jobs(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "bench-text",
                "data": {"uri": str(tmp_path / "tokens.lance")},
                "task": {"name": "language_model"},
            }
        )
    )
    assert main([str(job), "--out", str(tmp_path / "out")]) == 2
    printed = capsys.readouterr()
    assert "task.name is 'language_model'" in printed.err and "image_classification jobs only" in printed.err
    assert not (tmp_path / "tokens.lance").exists() and not (tmp_path / "out").exists()  # refused before any work


def test_without_a_job_spec_outside_a_checkout_the_command_says_where_the_comparison_is(tmp_path, capsys, monkeypatch):
    """The peer comparison lives in the repository's benchmarks/, not in the package: installed from
    a wheel, ``lance-hpc bench`` without a spec says so. It never runs a benchmarks/ found in the
    working directory."""
    from lance_hpc.cli import bench as cli

    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "__main__.py").write_text("raise SystemExit('ran code from the working directory')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "checkout_root", lambda: None)
    with pytest.raises(SystemExit) as stopped:
        main(["--sections", "local"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "give a job spec" in error and "python -m benchmarks" in error


def test_the_handover_runs_the_checkouts_benchmarks_never_one_in_the_working_directory(tmp_path, capfd, monkeypatch):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "__init__.py").write_text("")
    (tmp_path / "benchmarks" / "__main__.py").write_text("raise SystemExit('ran code from the working directory')\n")
    monkeypatch.chdir(tmp_path)
    assert main(["--sections", "local", "--help"]) == 0
    printed = capfd.readouterr()
    assert "usage: python -m benchmarks" in printed.out and "working directory" not in printed.err


@pytest.mark.slow
def test_tune_searches_workers_prefetch_and_io_depth_and_writes_the_choice_back(tmp_path, capsys):
    data = prepare(
        DataSetSpec("small", count=128, image_size=32, batch_size=16, size=48, rows_per_fragment=50), tmp_path / "data"
    )
    job = tmp_path / "job.yaml"
    job.write_text(
        "# my job\n"
        "name: bench-tune\n"
        "slurm: {cpus_per_task: 2}\n"
        "data:\n"
        f"  uri: {data.lance_uri}   # the photos\n"
        "  batch_size: 16\n"
        "  num_workers: 1          # to be tuned\n"
        "task: {name: image_classification, options: {image_size: 32}}\n"
    )
    code = main([str(job), "--tune", "--out", str(tmp_path / "out"), "--seconds", "0.5", "--budget-s", "600", "--write"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    tried = re.findall(r"num_workers=(\d+) prefetch_factor=(\d+) io_depth=(\d+) +([\d,]+) images/s", printed)
    assert {row[0] for row in tried} == {"1", "2"} and {row[1] for row in tried} == {"2", "4"}
    assert {row[2] for row in tried} == {"0", "4", "8"}
    choice = re.search(r"choice: +num_workers=(\d+) prefetch_factor=(\d+) io_depth=(\d+): ([\d,]+) images/s", printed)
    assert choice and "runner-up:" in printed, printed
    rate = int(choice.group(4).replace(",", ""))
    assert rate == max(int(row[3].replace(",", "")) for row in tried)  # the best measured
    text = job.read_text()
    assert text.startswith("# my job\n") and "# the photos" in text  # comments kept
    written = yaml.safe_load(text)["data"]
    assert (written["num_workers"], written["prefetch_factor"], written["io_depth"]) == tuple(int(v) for v in choice.groups()[:3])
    assert "# to be tuned" in text or written["num_workers"] != 1


def test_request_rate_model_scales_measured_requests_per_image_to_gpus_and_prices_them():
    from benchmarks.request_model import request_rates

    rates = {(rate.strategy, rate.gpus): rate for rate in request_rates({"distributed": (1.0, 32.0), "block": (0.03, 32.0)})}
    one = rates[("distributed", 64)]  # 64 GPUs x 3,000 img/s x 1 GET
    assert one.gets_per_s == 192_000 and one.prefixes == 35 and one.mb_per_s == pytest.approx(6_144)
    assert one.usd_per_hour == pytest.approx(192_000 * 3600 / 1000 * 0.0004)
    assert rates[("block", 64)].prefixes == 2 and rates[("block", 8)].prefixes == 1


def test_shuffle_statistics_tell_a_random_order_from_a_class_ordered_scan():
    import numpy as np

    from benchmarks.shuffle_quality import batch_order, expected_distinct_labels
    from lance_hpc.loading.sampling import FragmentTable

    labels = np.repeat(np.arange(10), 100)  # written in class order, the worst case
    table = FragmentTable.from_rows([250, 250, 250, 250])
    assert expected_distinct_labels([100] * 10, 1) == pytest.approx(1.0)
    shuffled = batch_order(labels, table, "distributed", 16, epochs=1)
    scanned = batch_order(labels, table, "sharded_fragment", 16, epochs=1, shuffle=False)
    blocks = batch_order(labels, table, "block", 16, epochs=1, run_rows=10, window_runs=16)
    assert shuffled.distinct_ratio == pytest.approx(1.0, abs=0.05) and scanned.distinct_ratio < 0.2
    assert 0.7 < blocks.distinct_ratio <= 1.05 and blocks.spread_ratio > 0.8 > scanned.spread_ratio


def test_block_profile_splits_the_servers_requests_by_kind_and_times_them_in_flight(tmp_path):
    from benchmarks.block_profile import requests_of

    log = tmp_path / "requests.log"
    log.write_text(
        "".join(
            [
                "100.00\t100.10\tGET\t/bench/d/data/a.lance\t65536\n",  # a footer, when a worker opens a file
                "100.05\t100.20\tGET\t/bench/d/data/a.lance\t2097152\n",  # a run of rows
                "100.06\t100.20\tGET\t/bench/d/data/a.lance\t2097152\n",
                "100.10\t100.12\tGET\t/bench/d/data/a.lance\t900\n",  # page metadata
                "101.00\t101.00\tHEAD\t/bench/d/_latest.manifest\t0\n",
                "101.80\t102.00\tGET\t/bench/d/data/a.lance\t1048576\n",
            ]
        )
    )
    found = requests_of(log, images=100)
    assert found["gets_per_image"] == pytest.approx(0.05)
    assert found["run_gets_per_image"] == pytest.approx(0.03)
    assert found["footer_gets_per_image"] == pytest.approx(0.01) and found["small_gets_per_image"] == pytest.approx(0.01)
    assert found["mb_per_run_get"] == pytest.approx(2.0)
    assert found["requests_in_flight_share"] == pytest.approx(0.4 / 2.0, abs=0.02)  # 100.0-100.2 and 101.8-102.0


@pytest.mark.slow
def test_sharded_section_measures_every_configuration_against_ddp_in_the_same_run(tmp_path, capfd):
    """--tiny: a small GPT on 2 local ranks under ddp and fsdp (synchronous and background saves),
    and on 4 under ddp and fsdp (synchronous); every configuration measured, its figures put against
    ddp's, and fsdp holds half of ddp's state per rank on 2 ranks (a quarter on 4)."""
    code = main(["--tiny", "--sections", "sharded", "--out", str(tmp_path / "out")])
    printed = capfd.readouterr().out
    assert code == 0, printed
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    figures = {summary["label"]: summary["runs"][0][0] for summary in results["summaries"]}
    assert len(figures) == 5 and not any(result["error"] for result in figures.values()), figures
    for ranks, modes in ((2, ("fsdp sync", "fsdp async")), (4, ("fsdp sync",))):
        ddp = figures[f"ddp, {ranks} ranks, gpt-tiny"]["store"]
        for mode in modes:
            sharded = figures[f"{mode}, {ranks} ranks, gpt-tiny"]["store"]
            assert sharded["parameters"] == ddp["parameters"]
            assert sharded["state_bytes"] <= ddp["state_bytes"] / ranks * 1.1, (mode, ranks, sharded, ddp)
            assert sharded["tokens_per_s"] > 0 and 0 < sharded["blocked_s"] <= sharded["complete_s"]
    markdown = (tmp_path / "out" / "results.md").read_text()
    assert "## Sharded training" in markdown and "| fsdp sync, 4 ranks, gpt-tiny |" in markdown


def _tiny_section(tmp_path, capfd, section: str) -> tuple[str, dict[str, dict]]:
    """One --tiny run of ``section``: what it printed, and each configuration's first run by label (none failed)."""
    code = main(["--tiny", "--sections", section, "--out", str(tmp_path / "out")])
    printed = capfd.readouterr().out
    assert code == 0, printed
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    figures = {summary["label"]: summary["runs"][0][0] for summary in results["summaries"]}
    assert not any(result["error"] for result in figures.values()), figures
    return printed, figures


@pytest.mark.slow
def test_refresh_section_puts_a_refresh_against_a_full_overwrite_in_the_same_run(tmp_path, capfd):
    """--tiny: the small set with its model columns, a tenth more rows appended; the refresh
    computes only those rows and writes a fraction of the overwrite's bytes, old files unchanged
    (the measurement fails otherwise), and the report prints both ratios."""
    printed, figures = _tiny_section(tmp_path, capfd, "refresh")
    refresh = figures["lance_hpc job: infer, refresh: missing (the appended rows)"]
    overwrite = figures["lance_hpc job: infer, overwrite: true (every row again)"]
    assert (refresh["images"], overwrite["images"]) == (38, 422), (refresh, overwrite)
    assert 0 < refresh["bytes_written"] < overwrite["bytes_written"] / 4, (refresh, overwrite)
    assert "refresh vs a full overwrite: work time:" in printed and "refresh vs a full overwrite: bytes written:" in printed
    assert "## Refresh" in (tmp_path / "out" / "results.md").read_text()


@pytest.mark.slow
def test_map_section_puts_a_map_job_against_its_data_pipeline_alone_in_the_same_run(tmp_path, capfd):
    """--tiny: job: map of a cheap function over the small set against reading the same column in the
    same batches; both read every row, and the report prints the ratio against its target."""
    printed, figures = _tiny_section(tmp_path, capfd, "map")
    job = figures["lance_hpc job: map, image_bytes (1 rank)"]
    pipeline = figures["the data pipeline alone: image column of each fragment in batches (1 process)"]
    assert job["images"] == pipeline["images"] == 384 and job["images_per_s"] > 0 and pipeline["images_per_s"] > 0, figures
    assert "job: map vs the data pipeline alone:" in printed, printed
    assert "## Map" in (tmp_path / "out" / "results.md").read_text()


@pytest.mark.slow
def test_loader_library_section_puts_the_loader_and_lance_torch_against_the_trainers_loader(tmp_path, capfd):
    """--tiny: one epoch of the small token set through the trainer's loader, lance_hpc.Loader with
    two strategies and lance.torch's LanceDataset; each reads the same rows (the first batch aside),
    and the report prints the Loader's ratio against its target and the like-for-like ratio against
    lance.torch, each by the rounds' ratios and by the median rates."""
    printed, figures = _tiny_section(tmp_path, capfd, "loader_library")
    rows = {label: result["images"] for label, result in figures.items()}
    assert len(rows) == 4 and len(set(rows.values())) == 1 and all(result["images_per_s"] > 0 for result in figures.values()), (
        figures
    )
    assert "lance_hpc.Loader (iterable/sharded_batch)" in rows, rows
    assert "Loader vs the trainer's loader:" in printed, printed
    assert "Loader iterable/sharded_batch vs lance.torch:" in printed, printed
    assert printed.count("by the ratio of the median rates") == 2, printed
    assert "## The Loader in your own loop" in (tmp_path / "out" / "results.md").read_text()
