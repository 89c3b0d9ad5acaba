"""
The experiment loop: run the kit's train.py on one core for a fixed budget, score it with the
trusted metric, log the result, keep the commit if val_bpb improved, reset to the best otherwise.

    python loop.py run [--description TEXT] [--budget 300] [--train-args "..."]   # one experiment
    python loop.py plot                                                          # progress.png
    python loop.py status                                                        # the results so far

`bash run.sh` is `python loop.py run`. Commit the change to train.py before each run: the row in
results.tsv names the commit, and a discarded experiment is undone with `git reset --hard`.
"""
from __future__ import annotations

import argparse
import csv
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KIT = HERE.parent  # the repository whose train.py the experiments edit
RESULTS = HERE / "results.tsv"
RUNS = HERE / "runs"
PLOT = HERE / "progress.png"
FIELDS = ("commit", "val_bpb", "memory_gb", "status", "description")
DEFAULT_BUDGET = 300.0  # seconds of charged training time per experiment
DEFAULT_EVAL_TOKENS = 2**19  # public_val tokens scored per experiment: the same for every row, so rows compare
LOG_TAIL_LINES = 30


class LoopError(Exception):
    pass


def git(*args: str) -> str:
    result = subprocess.run(["git", *args], cwd=KIT, capture_output=True, text=True)
    if result.returncode != 0:
        raise LoopError(f"git {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout.strip()


def read_results() -> list[dict]:
    if not RESULTS.exists():
        return []
    with open(RESULTS, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def append_result(row: dict) -> None:
    new = not RESULTS.exists()
    with open(RESULTS, "a", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, delimiter="\t", lineterminator="\n")
        if new:
            writer.writeheader()
        writer.writerow({k: " ".join(str(row[k]).split()) for k in FIELDS})  # no tabs or newlines in a field


def best_kept(rows: list[dict]) -> dict | None:
    kept = [r for r in rows if r["status"] == "keep"]
    return min(kept, key=lambda r: float(r["val_bpb"])) if kept else None


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


def single_core_env(device: str) -> dict:
    """One NeuronCore (or GPU) for the experiment, whatever the machine has."""
    env = dict(os.environ)
    if device == "neuron":
        env.setdefault("NEURON_RT_VISIBLE_CORES", "0")
        env.setdefault("NEURON_LOGICAL_NC_CONFIG", "1")
    elif device == "cuda":
        env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    return env


def run_logged(cmd: list[str], log_path: Path, env: dict, timeout: float) -> tuple[int | None, str]:
    """Run cmd with stdout+stderr into log_path; (return code or None if killed at timeout, the log)."""
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=KIT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = None
    return code, log_path.read_text(encoding="utf-8", errors="replace")


def tail(text: str, n: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def run_experiment(args) -> int:
    if git("rev-parse", "--is-inside-work-tree") != "true":
        raise LoopError(f"{KIT} is not a git repository")
    if git("status", "--porcelain", "--untracked-files=no"):
        raise LoopError("uncommitted changes to tracked files: commit the experiment first "
                        "(git commit -am 'what you changed'), so it can be kept or reset")
    commit = git("rev-parse", "--short=7", "HEAD")
    description = args.description or git("log", "-1", "--format=%s")
    device = args.device or default_device()
    train_args = shlex.split(args.train_args) if args.train_args is not None else \
        (["--preset", "cpu"] if device == "cpu" else [])
    run_dir = RUNS / f"{time.strftime('%Y%m%d-%H%M%S')}-{commit}"
    run_dir.mkdir(parents=True)
    checkpoint = run_dir / "out" / "final.pt"
    timeout = args.timeout if args.timeout else 2 * args.budget
    env = single_core_env(device)
    python = sys.executable
    train_cmd = [python, "train.py", *train_args, "--device", device, "--time-budget", str(args.budget),
                 "--eval-tokens", "0", "--out-dir", str(run_dir / "out")]
    print(f"[autoresearch] {commit}: {description}\n[autoresearch] training (budget {args.budget:.0f}s, killed at "
          f"{timeout:.0f}s), log {run_dir / 'train.log'}", flush=True)
    code, log = run_logged(train_cmd, run_dir / "train.log", env, timeout)
    failure = None
    if code is None:
        failure = f"timeout: killed after {timeout:.0f}s"
    elif code != 0 or not checkpoint.exists():
        failure = f"train.py exited with {code}"
    val_bpb, memory_gb = 0.0, 0.0
    if failure is None:
        memory_gb = float(summary_value(log, "peak_memory_mb") or 0) / 1024
        print("[autoresearch] scoring with prepare.py eval-public", flush=True)
        eval_cmd = [python, "prepare.py", "eval-public", "--train-py", "train.py", "--checkpoint", str(checkpoint),
                    "--device", device, "--max-tokens", str(args.eval_tokens)]
        code, log = run_logged(eval_cmd, run_dir / "eval.log", env, timeout)
        value = summary_value(log, "val_bpb")
        if code != 0 or value is None:
            failure = "timeout: evaluation killed" if code is None else f"eval-public exited with {code}"
        else:
            val_bpb = float(value)
    rows = read_results()
    best = best_kept(rows)
    if failure is not None:
        status = "crash"
        (run_dir / "crash.txt").write_text(f"{failure}\n\n{tail(log)}\n")
        print(f"[autoresearch] CRASH: {failure}\n--- last lines of the log ---\n{tail(log)}\n---", flush=True)
        description = f"{description} [{failure}; {tail(log, 1)[:200]}]"
    elif best is None or val_bpb < float(best["val_bpb"]):
        status = "keep"
    else:
        status = "discard"
    append_result({"commit": commit, "val_bpb": f"{val_bpb:.6f}", "memory_gb": f"{memory_gb:.1f}", "status": status,
                   "description": description})
    if status != "keep" and best is not None:
        git("reset", "--hard", best["commit"])
    plot_progress(read_results(), PLOT)
    verdict = {"keep": f"kept (best so far: {val_bpb:.6f})",
               "discard": f"discarded: {val_bpb:.6f} is not better than {best['val_bpb'] if best else '-'}; "
                          f"reset to {best['commit'] if best else '-'}",
               "crash": f"recorded as a crash; {'reset to ' + best['commit'] if best else 'nothing to reset to'}"}
    print(f"[autoresearch] {commit} {verdict[status]}\n[autoresearch] results: {RESULTS}, plot: {PLOT}", flush=True)
    return 0


def plot_progress(rows: list[dict], path: Path) -> None:
    """val_bpb per experiment, coloured by status, with the running best of the kept ones."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, ax = plt.subplots(figsize=(10, 5), dpi=100)
    scored = [float(r["val_bpb"]) for r in rows if r["status"] != "crash"]
    ceiling = max(scored) if scored else 1.0
    styles = {"keep": ("tab:green", "o", "kept"), "discard": ("tab:gray", "o", "discarded"),
              "crash": ("tab:red", "x", "crashed")}
    for status, (color, marker, label) in styles.items():
        xs = [i for i, r in enumerate(rows) if r["status"] == status]
        ys = [float(rows[i]["val_bpb"]) if status != "crash" else ceiling for i in xs]
        if xs:
            ax.scatter(xs, ys, c=color, marker=marker, label=label, zorder=3)
    best, steps_x, steps_y = None, [], []
    for i, r in enumerate(rows):
        if r["status"] == "keep" and (best is None or float(r["val_bpb"]) < best):
            best = float(r["val_bpb"])
        if best is not None:
            steps_x.append(i)
            steps_y.append(best)
    if steps_x:
        ax.step(steps_x, steps_y, where="post", color="tab:green", alpha=0.6, label="running best")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("experiment")
    ax.set_ylabel("val_bpb (lower is better)")
    ax.set_title(f"autoresearch: {len(rows)} experiments, {sum(r['status'] == 'keep' for r in rows)} kept"
                 + (f", best {best:.4f}" if best is not None else ""))
    ax.grid(alpha=0.3)
    if rows:
        ax.legend()
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def show_status(args) -> int:
    rows = read_results()
    if not rows:
        print("no experiments yet")
        return 0
    for r in rows:
        print("\t".join(r[k] for k in FIELDS))
    best = best_kept(rows)
    print(f"best: {best['val_bpb']} at {best['commit']}" if best else "no kept experiment")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run, score and keep or discard one experiment (the committed train.py)")
    p.add_argument("--description", default=None, help="for results.tsv (default: the commit message)")
    p.add_argument("--budget", type=float, default=float(os.environ.get("AUTORESEARCH_BUDGET", DEFAULT_BUDGET)),
                   help="charged training seconds (default 300, or $AUTORESEARCH_BUDGET)")
    p.add_argument("--timeout", type=float, default=None, help="kill the run after this many seconds (default: "
                                                               "twice the budget)")
    p.add_argument("--eval-tokens", type=int, default=DEFAULT_EVAL_TOKENS, help="public_val tokens to score")
    p.add_argument("--device", default=None, help="neuron, cuda or cpu (default: the fastest present)")
    p.add_argument("--train-args", default=None, help="extra train.py flags (default: --preset cpu on a CPU)")
    p.set_defaults(func=run_experiment)
    p = sub.add_parser("plot", help="draw progress.png from results.tsv")
    p.set_defaults(func=lambda a: plot_progress(read_results(), PLOT) or print(PLOT) or 0)
    p = sub.add_parser("status", help="print results.tsv and the best kept experiment")
    p.set_defaults(func=show_status)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except LoopError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
