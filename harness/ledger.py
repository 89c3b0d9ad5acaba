"""The budget ledger. train.py calls record_step_boundary(step) after every optimizer step.

Charged time = wall time from process start to the final checkpoint on disk, minus the start-up
allowance. Start-up lasts until the end of step TRAIN_STARTUP_STEPS_EXCLUDED - 1 (the fifth step),
capped at TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS. Steps must arrive consecutively from 0."""
from __future__ import annotations

import os
import time
from pathlib import Path

from harness.common import BudgetError
from harness.config import TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS, TRAIN_STARTUP_STEPS_EXCLUDED, TRAIN_TIME_BUDGET_SECONDS


def clock() -> float:
    """Seconds on the clock the ledger counts with: the kernel's boot clock on Linux (the clock
    /proc/self/stat gives the process's start on), else a monotonic clock. Never the wall clock,
    which NTP or settimeofday can step by seconds in the middle of a run."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


def process_start_time() -> float:
    """clock() at which this process started. Read from /proc on Linux, so the interpreter's start
    and the imports count; elsewhere, or where /proc gives a start after the import or more than
    PROCESS_START_LIMIT before it, the time this module was imported, which charges less."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start in ticks of the boot clock
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT
    plausible = hasattr(time, "CLOCK_BOOTTIME") and _IMPORTED_AT - PROCESS_START_LIMIT <= started <= _IMPORTED_AT
    return started if plausible else _IMPORTED_AT


_IMPORTED_AT = clock()
PROCESS_START_LIMIT = 3600.0  # s before the import: an earlier start read from /proc (a bogus one) is not believed
_PROCESS_START = process_start_time()


def _fresh_ledger() -> dict:
    return {"startup_end": None, "last_step": None, "first_step": 0, "carried_seconds": 0.0, "step_ends": []}


_LEDGER = _fresh_ledger()


def resume_ledger(next_step: int, charged_seconds: float) -> None:
    """Continue the ledger of an earlier process of the same run (a resumed run): the next call
    is record_step_boundary(next_step), and charged_seconds of that process already count. The
    resumed process gets its own start-up allowance (it compiles again), under the same rule."""
    if _LEDGER["last_step"] is not None:
        raise BudgetError("resume_ledger must be called before the first record_step_boundary")
    if not isinstance(next_step, int) or next_step < 0 or not charged_seconds >= 0:
        raise BudgetError(f"resume_ledger needs a step >= 0 and charged seconds >= 0, got {next_step!r}, "
                          f"{charged_seconds!r}")
    _LEDGER.update(first_step=next_step, carried_seconds=float(charged_seconds))


def record_step_boundary(step: int) -> dict:
    """Call after each optimizer step. Steps count from 0 (or from the step given to
    resume_ledger) and must arrive consecutively. Returns budget_status()."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise BudgetError(f"step must be a non-negative int, got {step!r}")
    expected = _LEDGER["first_step"] if _LEDGER["last_step"] is None else _LEDGER["last_step"] + 1
    if step != expected:
        raise BudgetError(f"record_step_boundary({step}): steps must arrive consecutively from "
                          f"{_LEDGER['first_step']}, one call after each optimizer step; expected step {expected}")
    now = clock()
    if _LEDGER["startup_end"] is None and step - _LEDGER["first_step"] >= TRAIN_STARTUP_STEPS_EXCLUDED - 1:
        _LEDGER["startup_end"] = now
    _LEDGER["last_step"] = step
    _LEDGER["step_ends"].append(now)
    return budget_status(now=now)


def median_step_seconds() -> float | None:
    """Median duration of the steps after start-up (None before there is one): printed beside the
    start-up seconds, so a start-up step far longer than the others is visible."""
    ends = _LEDGER["step_ends"][TRAIN_STARTUP_STEPS_EXCLUDED - 1:]
    durations = sorted(b - a for a, b in zip(ends, ends[1:]))
    if not durations:
        return None
    mid = len(durations) // 2
    return durations[mid] if len(durations) % 2 else 0.5 * (durations[mid - 1] + durations[mid])


def budget_status(budget_seconds: float = TRAIN_TIME_BUDGET_SECONDS, now: float | None = None) -> dict:
    """Seconds charged so far against the budget. Until start-up ends, all elapsed time counts as
    start-up (so nothing is charged below the cap)."""
    now = clock() if now is None else now
    elapsed = now - _PROCESS_START
    startup = (_LEDGER["startup_end"] - _PROCESS_START) if _LEDGER["startup_end"] is not None else elapsed
    allowance = min(startup, TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS)
    charged = _LEDGER["carried_seconds"] + elapsed - allowance
    return {"elapsed_seconds": elapsed, "startup_seconds": startup, "startup_allowance_seconds": allowance,
            "startup_complete": _LEDGER["startup_end"] is not None, "charged_seconds": charged,
            "carried_seconds": _LEDGER["carried_seconds"], "budget_seconds": budget_seconds,
            "remaining_seconds": budget_seconds - charged, "over_budget": charged > budget_seconds,
            "last_step": _LEDGER["last_step"]}


def charged_seconds() -> float:
    return budget_status()["charged_seconds"]

