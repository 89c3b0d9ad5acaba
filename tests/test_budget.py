"""The budget ledger: charged time = wall time since process start minus the start-up allowance."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import prepare
from harness import ledger
from helpers import REPO


@pytest.fixture
def clock(monkeypatch):
    """A fake clock: the process started at t=1000."""
    now = {"t": 1000.0}
    monkeypatch.setattr(ledger, "_PROCESS_START", 1000.0)
    monkeypatch.setattr(ledger, "_LEDGER", ledger._fresh_ledger())
    monkeypatch.setattr(ledger, "clock", lambda: now["t"])
    return now


def test_constants():
    assert prepare.TRAIN_STARTUP_STEPS_EXCLUDED == 5 and prepare.TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS == 900
    assert prepare.EVAL_TIMEOUT_SECONDS == 1200 and prepare.TOKENIZER_VOCAB_SIZE == 8192


def test_startup_until_the_end_of_step_four_is_not_charged(clock):
    for step in range(4):
        clock["t"] = 1100.0 + 10 * step
        s = prepare.record_step_boundary(step)
        assert not s["startup_complete"] and s["charged_seconds"] == 0.0
    clock["t"] = 1300.0
    s = prepare.record_step_boundary(4)  # the end of step TRAIN_STARTUP_STEPS_EXCLUDED - 1: the clock starts
    assert s["startup_complete"] and s["startup_allowance_seconds"] == 300.0 and s["charged_seconds"] == 0.0
    clock["t"] = 1300.0 + 1800.0
    s = prepare.record_step_boundary(5)
    assert s["charged_seconds"] == 1800.0 and not s["over_budget"]
    clock["t"] += 0.5
    assert prepare.budget_status()["over_budget"] and prepare.charged_seconds() == 1800.5


def _steps(clock, first, last, seconds):
    for step in range(first, last + 1):
        clock["t"] += seconds
        prepare.record_step_boundary(step)


def test_startup_allowance_is_capped(clock):
    clock["t"] = 1000.0 + 995.0
    _steps(clock, 0, 4, 1.0)
    s = prepare.budget_status()
    assert s["startup_allowance_seconds"] == 900.0 and s["charged_seconds"] == 100.0
    assert s["remaining_seconds"] == prepare.TRAIN_TIME_BUDGET_SECONDS - 100.0


def test_steps_must_arrive_consecutively_from_zero(clock):
    with pytest.raises(prepare.BudgetError, match="expected step 0"):
        prepare.record_step_boundary(3)
    prepare.record_step_boundary(0)
    for bad in (0, 2, 7):
        with pytest.raises(prepare.BudgetError, match="consecutively.*expected step 1"):
            prepare.record_step_boundary(bad)
    prepare.record_step_boundary(1)


def test_median_step_seconds_sits_beside_an_oversized_startup(clock):
    clock["t"] = 1000.0 + 600.0  # a first step that trains for 10 minutes, uncharged
    prepare.record_step_boundary(0)
    assert prepare.median_step_seconds() is None
    _steps(clock, 1, 4, 1.0)
    _steps(clock, 5, 9, 2.0)
    assert prepare.median_step_seconds() == 2.0
    assert prepare.budget_status()["startup_seconds"] == 604.0


def test_a_resumed_run_carries_its_charged_time_and_step(clock):
    prepare.resume_ledger(100, 250.0)
    with pytest.raises(prepare.BudgetError, match="expected step 100"):
        prepare.record_step_boundary(0)
    clock["t"] = 1000.0 + 30.0
    _steps(clock, 100, 104, 1.0)  # the resumed process's own start-up: 35 s, not charged
    clock["t"] += 10.0
    assert prepare.budget_status()["charged_seconds"] == 260.0
    with pytest.raises(prepare.BudgetError, match="before the first"):
        prepare.resume_ledger(5, 0.0)


def test_before_startup_ends_only_time_beyond_the_cap_is_charged(clock):
    clock["t"] = 1000.0 + 950.0
    assert prepare.budget_status()["charged_seconds"] == 50.0


def test_a_custom_budget(clock):
    clock["t"] = 1000.0 + 15.0
    _steps(clock, 0, 4, 1.0)
    clock["t"] += 301.0
    assert prepare.budget_status(budget_seconds=300)["over_budget"]


def test_bad_step_is_rejected(clock):
    for bad in (-1, 1.0, True, "0"):
        with pytest.raises(prepare.BudgetError, match="non-negative int"):
            prepare.record_step_boundary(bad)


@pytest.mark.skipif(not hasattr(time, "CLOCK_BOOTTIME"), reason="the process start is read from Linux's /proc")
def test_process_start_is_before_import():
    assert ledger._PROCESS_START <= ledger._IMPORTED_AT <= ledger.clock()
    assert ledger.process_start_time() == ledger._PROCESS_START  # one clock: the same answer at any later time
    assert ledger._IMPORTED_AT - ledger._PROCESS_START < ledger.PROCESS_START_LIMIT


class FakeStat:
    """/proc/self/stat of a process that started at `started` seconds on the boot clock."""

    def __init__(self, started: float):
        self.line = "1234 (py thon) S " + " ".join(["0"] * 18 + [str(round(started * os.sysconf("SC_CLK_TCK")))] * 2)

    def __call__(self, path):
        return self

    def read_text(self):
        return self.line


@pytest.mark.skipif(not hasattr(time, "CLOCK_BOOTTIME"), reason="the process start is read from Linux's /proc")
def test_a_process_start_that_cannot_be_is_replaced_by_the_import_time(monkeypatch):
    """A start read from /proc after the import, or more than PROCESS_START_LIMIT before it (a bogus /proc),
    is not believed: the import time charges less."""
    monkeypatch.setattr(ledger, "_IMPORTED_AT", 10_000.0)
    for started, believed in ((9_000.0, 9_000.0), (10_000.0, 10_000.0), (10_001.0, 10_000.0),
                              (10_000.0 - ledger.PROCESS_START_LIMIT - 1, 10_000.0), (0.0, 10_000.0)):
        monkeypatch.setattr(ledger, "Path", FakeStat(started))
        assert ledger.process_start_time() == believed, started


def test_the_interpreter_start_and_imports_are_counted():
    code = "import time; time.sleep(0.5); from harness import ledger; print(ledger.budget_status()['elapsed_seconds'])"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert 0.5 <= float(out.stdout) < 60


def test_a_step_of_the_wall_clock_is_not_charged(monkeypatch):
    """NTP or settimeofday can step time.time() by seconds mid-run: charged time
    follows the elapsed seconds, not the wall clock's jumps."""
    monkeypatch.setattr(ledger, "_LEDGER", ledger._fresh_ledger())
    before = ledger.budget_status()["elapsed_seconds"]
    wall = time.time
    for jump in (3600.0, -3600.0):
        monkeypatch.setattr(time, "time", lambda jump=jump: wall() + jump)
        assert 0 <= ledger.budget_status()["elapsed_seconds"] - before < 5.0
        assert ledger.process_start_time() == ledger._PROCESS_START <= ledger._IMPORTED_AT  # read again after it


@pytest.mark.slow
def test_phase_two_budget_from_the_environment():
    code = "import prepare; print(prepare.TRAIN_TIME_BUDGET_SECONDS)"
    env = dict(os.environ, FRONTIER_PHASE="2")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "14400"
    env["FRONTIER_PHASE"] = "3"
    bad = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "FRONTIER_PHASE must be 1 or 2" in bad.stderr
