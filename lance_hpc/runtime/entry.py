"""Running a job's entry function in a rank: the resume point found and announced, the metric
logger, the :class:`~lance_hpc.runtime.context.Context`, the watchdog and the profiler started, and
how the entry ended turned into a :class:`~lance_hpc.runtime.context.Summary`."""

from __future__ import annotations

import numbers
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lance_hpc.checkpoint import resuming
from lance_hpc.checkpoint.manifests import CHECKPOINT_PATTERN
from lance_hpc.checkpoint.resuming import Checkpoint
from lance_hpc.errors import UserError
from lance_hpc.runtime import attempt
from lance_hpc.runtime.context import Context, Summary
from lance_hpc.runtime.environment import DistEnv, configure_process
from lance_hpc.runtime.metrics import build_logger
from lance_hpc.runtime.preemption import Preemption
from lance_hpc.runtime.step_loop import Preempted, StopNotHonoured
from lance_hpc.spec import JobSpec, TrainSpec
from lance_hpc.spec.flat import flatten
from lance_hpc.spec.named_code import entry_options
from lance_hpc.tasks import Task


def run_entry(
    entry: Callable[[Context], Any], spec: JobSpec, env: DistEnv, device: torch.device, preemption: Preemption, task: Task
) -> Summary:
    """Run a job's entry function in this rank; a preemption inside :meth:`Context.steps` ends it."""
    configure_process(spec.train.seed, spec.train.deterministic, env, device)
    resumed = resuming.find_resume_point(spec)
    if resumed and env.is_main and not _ended(resumed, spec.train):
        print(
            resuming.resume_message(
                resumed,
                float(resumed.state.get("progress", resumed.epoch)),
                env.world_size,
                spec.data.batch_size,
                spec.train.grad_accum,
            ),
            flush=True,
        )
    logger = build_logger(spec, env.is_main, purge_step=resumed.step if resumed else None)
    logger.log_hparams(
        {**flatten(spec.redacted_dict()), "world_size": env.world_size}, (f"val/{task.headline_metric}", "val/loss")
    )
    context = Context(spec, env, device, task, logger, preemption, resumed, entry_options(entry, spec.entry_options))
    attempt.report_restart(context)
    with context.running():
        try:
            result = entry(context)
            context.wait_for_checkpoint()
        except torch.OutOfMemoryError as error:
            raise UserError(context.out_of_memory(error)) from None
        except Preempted as stop:
            return Summary("preempted", stop.step, context.epoch, stop.saved)
        except StopNotHonoured as stop:
            if env.is_main:
                print(f"lance_hpc.run: {stop}", file=sys.stderr, flush=True)
            return Summary("unsaved", context.step, context.epoch, None)
        except Exception:
            attempt.remember_step(context.step)  # for the failure note: the same error at the same step stops restarts
            raise
    # The work is done: what follows only reports it, and must not fail the rank (a restart would
    # run the entry's evaluation again), whatever the entry returned.
    returned = {str(tag): value for tag, value in result.items()} if isinstance(result, Mapping) else {}
    if env.is_main:
        print(final_line(task, returned, context.step), flush=True)
        print(checkpoint_line(context.last_checkpoint, context.resumed_from), flush=True)
    metrics = {tag: number for tag, value in returned.items() if (number := _number(value)) is not None}
    return Summary("completed", context.step, context.epoch, context.last_checkpoint, metrics)


def final_line(task: Task, returned: Mapping[str, Any], step: int) -> str:
    """``final validation accuracy: 0.9944 (loss 0.0243) after 270 steps``, or what the entry
    returned: every key as it is, a number to 4 significant digits, anything else as its repr
    cut to :data:`SHOWN_CHARS`."""
    metrics = {tag: number for tag, value in returned.items() if (number := _number(value)) is not None}
    if f"val/{task.headline_metric}" in metrics or "val/loss" in metrics:
        others = ", ".join(f"{tag} {_shown(value)}" for tag, value in returned.items() if tag not in metrics)
        return f"final validation {task.headline(metrics)} after {step} steps" + (f"; {others}" if others else "")
    values = ", ".join(f"{tag} {_shown(value)}" for tag, value in returned.items())
    return f"training finished after {step} steps" + (f": {values}" if values else "")


SHOWN_CHARS = 80  # of a returned value that is not a number, in the final line


def _number(value: Any) -> float | None:
    """A returned value as a number (a Python or NumPy number, a one-element tensor), or None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):  # a Real of the user's own that does not convert
            return None
    return None


def _shown(value: Any) -> str:
    number = _number(value)
    if number is not None:
        return f"{number:.4g}"
    try:
        text = repr(value)
    except Exception:  # the user's own __repr__ failing must not fail a finished run
        text = f"<{type(value).__name__}>"
    return text if len(text) <= SHOWN_CHARS else f"{text[: SHOWN_CHARS - 3]}..."


def checkpoint_line(saved: str | None, resumed_from: str | None) -> str:
    """Where a finished run left its state: ``checkpoint step 270: checkpoints/digits/step-00000270.pt``."""
    if saved is None and resumed_from is not None:
        return f"checkpoint: none saved by this run; the latest is {resumed_from}"
    if saved is None:
        return "checkpoint: none saved (the entry never called ctx.steps() or ctx.save())"
    named = CHECKPOINT_PATTERN.match(saved.rstrip("/").rsplit("/", 1)[-1])
    return f"checkpoint step {int(named.group(1))}: {saved}" if named else f"checkpoint: {saved}"


def _ended(resumed: Checkpoint, train: TrainSpec) -> bool:
    return resumed.epoch >= train.epochs or (train.max_steps is not None and resumed.step >= train.max_steps)
