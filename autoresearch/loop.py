"""
The experiment loop: train commits of the kit's train.py for a fixed budget, up to --slots of them
at once (one NeuronCore, GPU or share of the CPUs each), score each with the trusted metric, write
one row per experiment to results.tsv, and keep the branch at the best commit.

    python loop.py queue [COMMIT ...]                # hand commits (default: HEAD) to the loop
    python loop.py run [--slots N] [--wait] [--budget 300] [--train-args "..."]
    python loop.py status                            # results, the queue, what is running
    python loop.py plot                              # progress.png

`bash run.sh` is `python loop.py run`: it trains the queue, or HEAD when the queue is empty (one
experiment, as with a single slot). Each experiment trains and is scored from its slot's own
checkout of its commit (runs/slot<k>), so the working tree stays yours while it runs. An
experiment is compared with the best result known when it finishes: better is "keep", otherwise
"discard"; a crash, or a run still going at twice its budget, is "crash". After every result the
branch moves to the best commit, unless you are in the middle of an idea (uncommitted changes, or
a commit not yet queued): then it moves at the next chance (`queue`, a result, the loop's end).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from results import FIELDS, TableError, append_result, best_kept, locked, plot_progress, read_results, timestamp
from slots import MARKER, Slot, SlotError, kill_marked, pin_this_thread, plan_slots, run_logged, usable_cores

HERE = Path(__file__).resolve().parent
KIT = HERE.parent  # the repository whose train.py the experiments edit
RESULTS = HERE / "results.tsv"
PLOT = HERE / "progress.png"
RUNS = HERE / "runs"  # one folder per experiment (logs), the slots' checkouts, the queue, the locks
QUEUE = RUNS / "queue"  # one file per queued commit, oldest first by name
TABLE_LOCK = RUNS / ".table.lock"  # held to read-decide-append a row and to move the branch
LOOP_LOCK = RUNS / ".loop.lock"  # held by the one loop that runs experiments from this folder
DEFAULT_BUDGET = 300.0  # seconds of charged training time per experiment
DEFAULT_EVAL_TOKENS = 2**19  # public_val tokens scored per experiment: the same for every row, so rows compare
LOG_TAIL_LINES = 30
POLL_SECONDS = 0.5

GIT_LOCK = threading.Lock()  # worktree add/prune change metadata shared by all checkouts
PRINT_LOCK = threading.Lock()


class LoopError(Exception):
    pass


def say(message: str) -> None:
    with PRINT_LOCK:
        try:
            print("\n".join(f"[autoresearch] {line}" for line in message.splitlines()), flush=True)
        except BrokenPipeError:  # `run.sh | tee` after Ctrl-C took tee: stopping the slots matters more
            pass


def git_run(*args: str, cwd: Path = KIT) -> subprocess.CompletedProcess:
    # its own session: Ctrl-C in the terminal reaches only the loop, never a git half-way through
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, start_new_session=True)


def git(*args: str, cwd: Path = KIT, check: bool = True) -> str:
    result = git_run(*args, cwd=cwd)
    if check and result.returncode != 0:
        raise LoopError(f"git {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout.strip()


def tail(text: str, n: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def summary_value(log: str, key: str) -> str | None:
    """The value of `key: value` in the summary after `---`."""
    after = log.split("\n---\n")[-1] if "\n---\n" in log else ""
    for line in after.splitlines():
        if line.startswith(f"{key}:"):
            return line.split(":", 1)[1].strip()
    return None


def default_device() -> str:
    sys.path.insert(0, str(KIT))
    from prepare import detect_device_type
    return detect_device_type()


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def require_committed() -> None:
    if git("rev-parse", "--is-inside-work-tree") != "true":
        raise LoopError(f"{KIT} is not a git repository")
    if git("status", "--porcelain", "--untracked-files=no"):
        raise LoopError("uncommitted changes to tracked files: commit the experiment first "
                        "(git commit -am 'what you changed'), so it can be kept or reset")


# --- the queue ---------------------------------------------------------------------------------

def queue_entries() -> list[Path]:
    return sorted(QUEUE.glob("*.json")) if QUEUE.exists() else []


def enqueue(name: str, description: str | None) -> dict:
    commit = git("rev-parse", "--verify", "--quiet", f"{name}^{{commit}}", check=False)
    if not commit:
        raise LoopError(f"{name!r} is not a commit of {KIT}")
    entry = {"commit": commit, "description": description or git("log", "-1", "--format=%s", commit),
             "queued_ns": time.time_ns()}
    QUEUE.mkdir(parents=True, exist_ok=True)
    write_json(QUEUE / f"{entry['queued_ns']}-{commit[:7]}.json", entry)
    return entry


def read_entries(paths: list[Path]) -> list[dict]:
    entries = []
    for path in paths:
        try:
            entries.append(json.loads(path.read_text()))
        except FileNotFoundError:  # a queued one the loop claimed meanwhile
            pass
    return entries


def all_entries() -> list[dict]:
    """Every commit handed to the loop: those queued, and those taken from the queue (each
    experiment's folder keeps its entry)."""
    queued = queue_entries()  # first: one claimed meanwhile is in its run folder by the second glob
    return read_entries(queued + (list(RUNS.glob("*/entry.json")) if RUNS.exists() else []))


# --- the branch --------------------------------------------------------------------------------

def base_commit(rows: list[dict], entries: list[dict]) -> str | None:
    """Where ideas start: the best kept commit; before any is kept, the first commit ever queued
    (the baseline)."""
    best = best_kept(rows)
    if best is not None:
        return best["commit"]
    return min(entries, key=lambda e: e["queued_ns"])["commit"][:7] if entries else None


def current_branch() -> str | None:
    return git("symbolic-ref", "--quiet", "--short", "HEAD", check=False) or None


def settle_branch(branch: str) -> str | None:
    """Move `branch` to the base commit where that loses nothing; a line saying what happened, or
    None when it was there already. The caller holds TABLE_LOCK."""
    rows, entries = read_results(RESULTS), all_entries()
    target = base_commit(rows, entries)
    if target is None:
        return None
    target_full = git("rev-parse", f"{target}^{{commit}}")
    if current_branch() != branch:  # checked out elsewhere or not at all: a ref move loses nothing
        if git("rev-parse", "--quiet", "--verify", branch, check=False) == target_full:
            return None
        result = git_run("branch", "--force", branch, target_full)
        return f"moved {branch} to {target}" if result.returncode == 0 else \
            f"could not move {branch} to {target}: {result.stderr.strip()}"
    head = git("rev-parse", "HEAD")
    if head == target_full:
        return None
    if git("status", "--porcelain", "--untracked-files=no"):
        return f"{branch} stays at {head[:7]} for now (uncommitted changes); the best is {target}"
    if head[:7] not in {e["commit"][:7] for e in entries} | {r["commit"] for r in rows}:
        return f"{branch} stays at {head[:7]} for now (a commit not yet queued); the best is {target}"
    # --keep: should files change under our feet meanwhile, it refuses rather than overwrite them
    result = git_run("reset", "--quiet", "--keep", target_full)
    if result.returncode != 0:
        return f"{branch} stays at {head[:7]} for now ({result.stderr.strip()}); the best is {target}"
    return f"moved {branch} from {head[:7]} to {target}"


# --- one experiment ----------------------------------------------------------------------------

@dataclass
class Settings:
    device: str
    budget: float
    timeout: float
    eval_tokens: int
    train_args: list[str]
    branch: str


@dataclass
class Experiment:
    commit: str  # full hash
    description: str
    slot: Slot
    run_dir: Path
    start: str = ""
    recorded: bool = False


def slot_checkout(slot: Slot, commit: str) -> Path:
    """The slot's own worktree, at `commit`. One path per slot, reused: compile caches keyed on
    source paths stay warm, and nothing of an earlier experiment survives `git clean`."""
    path = RUNS / f"slot{slot.index}"
    with GIT_LOCK:
        valid = (path / ".git").is_file() and \
            git("rev-parse", "--show-toplevel", cwd=path, check=False) == str(path.resolve())
        if not valid:
            if path.exists():
                shutil.rmtree(path)
            git("worktree", "prune")
            git("worktree", "add", "--quiet", "--detach", "--force", str(path), commit)
            return path
    git("checkout", "--quiet", "--detach", "--force", commit, cwd=path)
    git("clean", "-ffdxq", cwd=path)
    return path


def failure_of(what: str, outcome: str, code: int | None, timeout: float) -> str | None:
    if outcome == "timeout":
        return f"timeout: {what} killed after {timeout:.0f}s"
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        return f"{what} was killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    return f"{what} exited with {code}" if code != 0 else None


def train_and_score(exp: Experiment, settings: Settings, stop: threading.Event) -> dict | None:
    """Train and score one experiment in its slot: the row's numbers, or None if stopped."""
    if not pin_this_thread(exp.slot):
        say(f"slot {exp.slot.index}: this OS cannot pin CPUs; the slot gets only its thread count")
    tree = slot_checkout(exp.slot, exp.commit)
    env = {**os.environ, **exp.slot.env, MARKER: str(exp.run_dir)}
    header = f"# {exp.slot.describe()}\n# commit {exp.commit}, checkout {tree}\n"
    python = sys.executable
    checkpoint = exp.run_dir / "out" / "final.pt"
    train_cmd = [python, "train.py", *settings.train_args, "--device", settings.device, "--time-budget",
                 str(settings.budget), "--eval-tokens", "0", "--out-dir", str(exp.run_dir / "out")]
    outcome, code, log = run_logged(train_cmd, tree, env, exp.run_dir / "train.log", settings.timeout, stop, header)
    if outcome == "stopped":
        return None
    failure = failure_of("train.py", outcome, code, settings.timeout)
    if failure is None and not checkpoint.exists():
        failure = "train.py exited with 0 but wrote no checkpoint"
    val_bpb, memory_gb = 0.0, 0.0
    if failure is None:
        memory_gb = float(summary_value(log, "peak_memory_mb") or 0) / 1024
        eval_cmd = [python, "prepare.py", "eval-public", "--train-py", "train.py", "--checkpoint", str(checkpoint),
                    "--device", settings.device, "--max-tokens", str(settings.eval_tokens)]
        outcome, code, log = run_logged(eval_cmd, tree, env, exp.run_dir / "eval.log", settings.timeout, stop, header)
        if outcome == "stopped":
            return None
        value = summary_value(log, "val_bpb")
        failure = failure_of("eval-public", outcome, code, settings.timeout)
        if failure is None and value is None:
            failure = "eval-public printed no val_bpb"
        if failure is None:
            val_bpb = float(value)
    return {"val_bpb": val_bpb, "memory_gb": memory_gb, "failure": failure, "log": log}


def record(exp: Experiment, result: dict, settings: Settings) -> None:
    """Judge the result against the best known now, append its row, move the branch, redraw."""
    with locked(TABLE_LOCK):
        best = best_kept(read_results(RESULTS))
        description, failure = exp.description, result["failure"]
        if failure is not None:
            status = "crash"
            (exp.run_dir / "crash.txt").write_text(f"{failure}\n\n{tail(result['log'])}\n")
            description = f"{description} [{failure}; {tail(result['log'], 1)[:200]}]"
        elif best is None or result["val_bpb"] < float(best["val_bpb"]):
            status = "keep"
        else:
            status = "discard"
        append_result(RESULTS, {"commit": exp.commit[:7], "val_bpb": f"{result['val_bpb']:.6f}",
                                "memory_gb": f"{result['memory_gb']:.1f}", "status": status,
                                "slot": exp.slot.index, "start": exp.start, "end": timestamp(),
                                "description": description})
        exp.recorded = True
        (exp.run_dir / "outcome.txt").write_text(status + "\n")
        moved = settle_branch(settings.branch)
        plot_progress(read_results(RESULTS), PLOT)
    bar = f"{best['val_bpb']} ({best['commit']})" if best else "-"
    verdict = {"keep": f"kept: {result['val_bpb']:.6f}, " + (f"better than {bar}" if best else "the first result"),
               "discard": f"discarded: {result['val_bpb']:.6f} is not better than {bar}",
               "crash": f"CRASH: {failure}\n--- last lines of {exp.run_dir.name}'s log ---\n"
                        f"{tail(result['log'])}\n---"}[status]
    say(f"slot {exp.slot.index} {exp.commit[:7]} {verdict}" + (f"\n{moved}" if moved else ""))


def experiment_thread(exp: Experiment, settings: Settings, stop: threading.Event) -> None:
    try:
        result = train_and_score(exp, settings, stop)
    except Exception as e:  # the loop's own failure (a checkout, a disk): a crash row, and the other slots go on
        result = None if stop.is_set() else \
            {"val_bpb": 0.0, "memory_gb": 0.0, "failure": f"loop error: {e}", "log": traceback.format_exc()}
    if result is None:
        (exp.run_dir / "interrupted.txt").write_text("stopped by the loop before it finished: no row\n")
        return
    record(exp, result, settings)


# --- the scheduler -----------------------------------------------------------------------------

def new_run_dir(commit: str, slot: Slot) -> Path:
    stem = f"{time.strftime('%Y%m%d-%H%M%S')}-s{slot.index}-{commit[:7]}"
    for n in range(1, 100):
        path = RUNS / (stem if n == 1 else f"{stem}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise LoopError(f"cannot make a run folder {stem} under {RUNS}")


def claim(entry_path: Path, slot: Slot) -> Experiment:
    entry = json.loads(entry_path.read_text())
    run_dir = new_run_dir(entry["commit"], slot)
    exp = Experiment(entry["commit"], entry["description"], slot, run_dir, timestamp())
    write_json(run_dir / "entry.json", {**entry, "slot": slot.index, "start": exp.start})
    entry_path.unlink()
    return exp


def unfinished_runs() -> list[Path]:
    """The entries of experiments started but neither recorded nor marked interrupted."""
    return [p for p in sorted(RUNS.glob("*/entry.json")) if not (p.parent / "outcome.txt").exists()
            and not (p.parent / "interrupted.txt").exists()] if RUNS.exists() else []


def hold_loop_lock():
    """The one loop of this folder: two would train the same slots and the same queue."""
    RUNS.mkdir(parents=True, exist_ok=True)
    f = open(LOOP_LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or "?"
        f.close()
        raise LoopError(f"another loop is running experiments from {HERE} (pid {pid}): "
                        f"queue commits for it with `python loop.py queue`, or stop it first")
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def run_queue(args) -> int:
    branch = current_branch()
    if branch is None:
        raise LoopError("HEAD is detached: check out the branch the loop should keep at the best commit "
                        "(git checkout -b autoresearch/<tag>)")
    device = args.device or default_device()
    cuda_count = None
    if device == "cuda":
        import torch
        cuda_count = torch.cuda.device_count()
    slots = plan_slots(device, args.slots, os.environ, usable_cores(), cuda_count)
    train_args = shlex.split(args.train_args) if args.train_args is not None else \
        (["--preset", "cpu"] if device == "cpu" else [])
    settings = Settings(device, args.budget, args.timeout or 2 * args.budget, args.eval_tokens, train_args, branch)
    lock = hold_loop_lock()
    try:
        read_results(RESULTS)  # a table of another format is refused before anything trains
        left = kill_marked(str(RUNS) + os.sep)
        if left:
            say(f"stopped {len(left)} process(es) an earlier loop left running: {sorted(left)}")
        abandoned = unfinished_runs()
        for path in abandoned:  # their loop died without a word: they stay out of the table, and say so
            (path.parent / "interrupted.txt").write_text("its loop ended before it finished: no row\n")
        if abandoned:
            say("not recorded, their loop ended before they finished (queue them again to train them): "
                + " ".join(json.loads(p.read_text())["commit"][:7] for p in abandoned))
        if not queue_entries():
            require_committed()
            enqueue("HEAD", args.description)
        say(f"{len(slots)} slot(s) on {device}, budget {settings.budget:.0f}s each (killed at "
            f"{settings.timeout:.0f}s), train.py {shlex.join(train_args) or '(defaults)'}\n"
            + "\n".join(s.describe() for s in slots))
        return schedule(slots, settings, args.wait)
    finally:
        lock.close()


def schedule(slots: list[Slot], settings: Settings, wait: bool) -> int:
    """Start a queued commit in every free slot until the queue is empty (with wait: until Ctrl-C).
    Ctrl-C or SIGTERM only sets a flag, read here between polls: the experiments in flight are then
    stopped, whole trees, and get no row; rows already written stay; the table is never half-written."""
    signalled = []
    handlers = {s: signal.signal(s, lambda signum, frame: signalled.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    stop = threading.Event()
    running: dict[int, tuple[threading.Thread, Experiment]] = {}
    try:
        while not signalled:
            for k, (thread, _) in list(running.items()):
                if not thread.is_alive():
                    thread.join()
                    del running[k]
            free = [s for s in slots if s.index not in running]
            for slot, entry in zip(free, queue_entries()):
                exp = claim(entry, slot)
                say(f"slot {slot.index} {exp.commit[:7]}: {exp.description} (log {exp.run_dir / 'train.log'})")
                thread = threading.Thread(target=experiment_thread, args=(exp, settings, stop), daemon=True)
                running[slot.index] = (thread, exp)
                thread.start()
            if not running and not wait and not queue_entries():
                break
            time.sleep(POLL_SECONDS)
    finally:
        if running:  # Ctrl-C, SIGTERM, or the loop's own error: nothing may outlive it
            in_flight = sum(thread.is_alive() for thread, _ in running.values())
            say(f"stopping: the {in_flight} experiment(s) in flight are killed and get no row")
            stop.set()
            for thread, _ in running.values():
                thread.join()
            lost = [exp for _, exp in running.values() if not exp.recorded]
            if lost:
                say("interrupted, not recorded (to train them again: `python loop.py queue "
                    + " ".join(e.commit[:7] for e in lost) + "`):\n"
                    + "\n".join(f"  slot {e.slot.index} {e.commit[:7]}: {e.description}" for e in lost))
        for s, handler in handlers.items():
            signal.signal(s, handler)
        with locked(TABLE_LOCK):
            moved = settle_branch(settings.branch)
            rows = read_results(RESULTS)
        best = best_kept(rows)
        say((f"{moved}\n" if moved else "") + f"results: {RESULTS} ({len(rows)} rows), plot: {PLOT}, best: "
            + (f"{best['val_bpb']} at {best['commit']}" if best else "none kept yet"))
    return 130 if signalled else 0


# --- the other commands ------------------------------------------------------------------------

def queue_commits(args) -> int:
    if not args.commits:
        require_committed()
    for name in args.commits or ["HEAD"]:
        entry = enqueue(name, args.description)
        say(f"queued {entry['commit'][:7]}: {entry['description']}")
    branch = current_branch()
    if branch is not None:
        with locked(TABLE_LOCK):
            moved = settle_branch(branch)
        if moved:
            say(moved)
    say(f"{len(queue_entries())} commit(s) waiting" + ("" if loop_is_running() else
                                                       "; no loop is running: start one with `bash run.sh --slots N`"))
    return 0


def loop_is_running() -> bool:
    if not LOOP_LOCK.exists():
        return False
    with open(LOOP_LOCK) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def show_status(args) -> int:
    rows = read_results(RESULTS)
    print("\t".join(FIELDS))
    for r in rows:
        print("\t".join(r[k] for k in FIELDS))
    best = best_kept(rows)
    print(f"best: {best['val_bpb']} at {best['commit']}" if best else "no kept experiment")
    alive = loop_is_running()
    if alive:
        for e in read_entries(unfinished_runs()):
            print(f"running in slot {e['slot']} since {e['start']}: {e['commit'][:7]} {e['description']}")
    for e in read_entries(queue_entries()):
        print(f"queued: {e['commit'][:7]} {e['description']}")
    print("a loop is running" if alive else "no loop is running")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="train the queue (or HEAD, if the queue is empty), up to --slots at once")
    p.add_argument("--slots", type=int, default=int(os.environ.get("AUTORESEARCH_SLOTS", 1)),
                   help="experiments at once: one NeuronCore, GPU or share of the CPUs each (default 1, "
                        "or $AUTORESEARCH_SLOTS)")
    p.add_argument("--wait", action="store_true", help="when the queue is empty, wait for more (until Ctrl-C)")
    p.add_argument("--description", default=None, help="for HEAD's row (default: the commit message)")
    p.add_argument("--budget", type=float, default=float(os.environ.get("AUTORESEARCH_BUDGET", DEFAULT_BUDGET)),
                   help="charged training seconds (default 300, or $AUTORESEARCH_BUDGET)")
    p.add_argument("--timeout", type=float, default=None, help="kill a run after this many seconds (default: "
                                                               "twice the budget)")
    p.add_argument("--eval-tokens", type=int, default=DEFAULT_EVAL_TOKENS, help="public_val tokens to score")
    p.add_argument("--device", default=None, help="neuron, cuda or cpu (default: the fastest present)")
    p.add_argument("--train-args", default=None,
                   help="extra train.py flags (default on a CPU: --preset cpu)")
    p.set_defaults(func=run_queue)
    p = sub.add_parser("queue", help="queue commits (default: HEAD, then back to the best commit)")
    p.add_argument("commits", nargs="*", help="commits to train (default: HEAD)")
    p.add_argument("--description", default=None, help="for their rows (default: each commit's message)")
    p.set_defaults(func=queue_commits)
    p = sub.add_parser("plot", help="draw progress.png from results.tsv")
    p.set_defaults(func=lambda a: plot_progress(read_results(RESULTS), PLOT) or print(PLOT) or 0)
    p = sub.add_parser("status", help="print results.tsv, the best kept experiment, the queue, what runs")
    p.set_defaults(func=show_status)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (LoopError, SlotError, TableError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
