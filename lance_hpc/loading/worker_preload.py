"""What the DataLoader workers' server imports before any worker forks from it (see
:mod:`lance_hpc.loading.worker_server`): each worker then starts with these imported instead of
importing them itself, for every loader of the rank."""

import warnings

# Lance warns at every fork of a process that imported it; this one never uses it, its forks do.
warnings.filterwarnings("ignore", message="lance is not fork-safe", category=UserWarning)

import lance  # noqa: E402, F401
import numpy  # noqa: E402, F401
import PIL.Image  # noqa: E402, F401
import pydantic  # noqa: E402, F401
import simplejpeg  # noqa: E402, F401
import torch  # noqa: E402, F401

import lance_hpc.loading.iterable  # noqa: E402, F401
import lance_hpc.loading.mapstyle  # noqa: E402, F401
import lance_hpc.loading.reader  # noqa: E402, F401
import lance_hpc.loading.workers  # noqa: E402, F401
import lance_hpc.tasks.image  # noqa: E402, F401
import lance_hpc.tasks.language  # noqa: E402, F401
