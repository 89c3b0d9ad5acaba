"""
results.tsv, one row per finished experiment, and progress.png drawn from it.

Experiments in several slots finish at any moment, so a row is added under an exclusive lock (a
lock file beside the runs) by writing the whole table to a temporary name and renaming it: a
reader, or a loop killed mid-write, sees the table before or after the row, never half a row.
"""
from __future__ import annotations

import csv
import fcntl
import io
import os
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

FIELDS = ("commit", "val_bpb", "memory_gb", "status", "slot", "start", "end", "description")


class TableError(Exception):
    pass


@contextmanager
def locked(lock_path: Path):
    """An exclusive lock, across threads and processes, for as long as the block runs."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter="\t")
        if reader.fieldnames is not None and tuple(reader.fieldnames) != FIELDS:
            raise TableError(f"{path} has the columns {', '.join(reader.fieldnames)}; this loop writes "
                             f"{', '.join(FIELDS)}: move the old table aside (it is yours to keep)")
        return list(reader)


def format_row(row: dict) -> str:
    out = io.StringIO()
    csv.DictWriter(out, fieldnames=FIELDS, delimiter="\t", lineterminator="\n").writerow(
        {k: " ".join(str(row[k]).split()) for k in FIELDS})  # no tabs or newlines inside a field
    return out.getvalue()


def append_result(path: Path, row: dict) -> None:
    """Add one row; the caller holds the table's lock."""
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if not old:
        old = "\t".join(FIELDS) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(old + format_row(row))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def best_kept(rows: list[dict]) -> dict | None:
    kept = [r for r in rows if r["status"] == "keep"]
    return min(kept, key=lambda r: float(r["val_bpb"])) if kept else None


def timestamp() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def seconds_since(start: datetime, when: str) -> float:
    return (datetime.fromisoformat(when) - start).total_seconds()


def plot_progress(rows: list[dict], path: Path) -> None:
    """val_bpb over wall time: a bar from start to end per experiment, coloured by slot, its marker
    by status (kept: large and outlined; discarded: faint; crashed: x at the top), and the running
    best stepping through the kept ones in the order they finished."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    fig, ax = plt.subplots(figsize=(11, 5), dpi=100)
    scored = [float(r["val_bpb"]) for r in rows if r["status"] != "crash"]
    ceiling = max(scored) if scored else 1.0
    origin = min((datetime.fromisoformat(r["start"]) for r in rows), default=None)
    span = max((seconds_since(origin, r["end"]) for r in rows), default=0.0)
    unit, per = ("hours", 3600) if span > 7200 else ("minutes", 60)

    def at(when: str) -> float:
        return seconds_since(origin, when) / per
    colors = plt.get_cmap("tab10")
    slots = sorted({int(r["slot"]) for r in rows})
    looks = {"keep": dict(marker="o", s=70, edgecolors="black", linewidths=1.2, alpha=1.0),
             "discard": dict(marker="o", s=30, alpha=0.45),
             "crash": dict(marker="x", s=45, alpha=0.9)}
    for r in rows:
        y = float(r["val_bpb"]) if r["status"] != "crash" else ceiling
        start, end = at(r["start"]), at(r["end"])
        color = colors(int(r["slot"]) % 10)
        ax.plot([start, end], [y, y], color=color, alpha=0.35, linewidth=2, solid_capstyle="butt")
        ax.scatter([end], [y], color=color, zorder=3, **looks[r["status"]])
    best, steps_x, steps_y = None, [], []
    for r in sorted(rows, key=lambda r: at(r["end"])):
        if r["status"] == "keep" and (best is None or float(r["val_bpb"]) < best):
            best = float(r["val_bpb"])
            steps_x.append(at(r["end"]))
            steps_y.append(best)
    if steps_x:
        ax.step(steps_x + [span / per], steps_y + [steps_y[-1]], where="post", color="tab:green", alpha=0.7)
    handles = [Line2D([], [], color=colors(s % 10), linewidth=3, label=f"slot {s}") for s in slots]
    handles += [Line2D([], [], color="gray", linestyle="", label=label, markersize=8,
                       marker=looks[status]["marker"], markeredgecolor="black" if status == "keep" else "gray")
                for status, label in (("keep", "kept"), ("discard", "discarded"), ("crash", "crashed"))]
    handles.append(Line2D([], [], color="tab:green", alpha=0.7, label="running best"))
    ax.set_xlabel(f"wall time ({unit} since the first experiment started)")
    ax.set_ylabel("val_bpb (lower is better)")
    ax.set_title(f"autoresearch: {len(rows)} experiments in {len(slots)} slot(s), "
                 f"{sum(r['status'] == 'keep' for r in rows)} kept"
                 + (f", best {best:.4f}" if best is not None else ""))
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
