#!/usr/bin/env bash
# Sets up a fresh machine and runs the whole test suite, the real-cluster, multi-process and S3
# tests included. Needs root (or sudo) for the Debian packages of the test SLURM cluster.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# The SLURM test cluster (slurmctld + two slurmd on loopback) runs Debian's packages.
missing=()
for command in slurmctld slurmd sbatch munged; do
  command -v "$command" >/dev/null 2>&1 || missing+=("$command")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing SLURM and munge (missing: ${missing[*]})"
  as_root apt-get update -q
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge
fi

# torch/torchvision come as a matched pair from the package registry (setup.cfg pins the range).
python3 -m pip install -q --upgrade-strategy only-if-needed -e '.[test]'

# Style and types before the tests (configured in pyproject.toml): the formatter, the linter, mypy.
python3 -m ruff format --check --quiet lance_hpc benchmarks tests examples
python3 -m ruff check --quiet lance_hpc benchmarks tests examples
python3 -m mypy

# The documentation site builds without a warning (a broken link or anchor, a page missing from the
# nav fails it), into a temporary directory so that no site/ is left in the checkout.
site_dir="$(mktemp -d)"
trap 'rm -rf "$site_dir"' EXIT
python3 -m mkdocs build --strict --site-dir "$site_dir"

# Two test processes (pytest-xdist): the SLURM cluster's tests, grouped in one (see tests/conftest.py),
# spend much of their time waiting on the scheduler, which the other process's tests use.
# The slowest tests, and those that cost the most CPU (tests/support/cpu.py), are listed at the end,
# so the suite's time can be kept in check.
python3 -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --durations=30 "$@"
