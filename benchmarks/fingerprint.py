"""A behaviour fingerprint of train.py: fixed-seed fp32 eager runs whose every step's loss and final weights
are recorded exactly, so that a refactor can be shown to change nothing (same fingerprint before and after).

    python benchmarks/fingerprint.py --out before.json            # on the old code
    python benchmarks/fingerprint.py --out after.json --compare before.json

Runs (each 30 steps, --dtype fp32 --no-compile, the stdlib data of FRONTIER_CACHE_DIR, built if missing): the
default architecture at a small width, the same with every ingredient on, and 2-rank torchruns of the first,
sharded (ZeRO-1) and unsharded with 4 micro-batches a step. It holds the SHA-256 of every tensor of final.pt, its
model_config and recipe, and the loss printed at every step."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--depth", "2", "--aspect-ratio", "64", "--head-dim", "32", "--seq-len", "128", "--device-batch-size", "4",
         "--total-batch-size", "1024", "--max-steps", "30", "--time-budget", "3600", "--dtype", "fp32", "--no-compile",
         "--device", "cpu", "--log-every", "1", "--eval-tokens", "0", "--seed", "7"]
EVERY = ["--value-embeds", "alternate", "--window-pattern", "SL", "--short-window", "48"]
RUNS = {  # name: (ranks, flags, build_optimizer's overrides)
    "default": (1, SMALL, {}),
    "every-ingredient": (1, SMALL + EVERY, {}),
    "two-ranks-sharded": (2, SMALL, {"shard": True, "bucket_mb": 0.1}),
    "two-ranks-accumulating": (2, SMALL + ["--device-batch-size", "1"], {"shard": False, "bucket_mb": 0.1}),
}
# train.py's main with build_optimizer's sharding and buckets set (they are not flags)
LAUNCHER = """import functools, sys
import train as T
T.build_optimizer = functools.partial(T.build_optimizer, **{overrides!r})
sys.exit(T.main(sys.argv[1:]))
"""


def run(name: str, ranks: int, args: list[str], overrides: dict, work: Path) -> dict:
    out = work / name
    script = work / f"{name}.py"
    script.write_text(LAUNCHER.format(overrides=overrides))
    launcher = [sys.executable, str(script)] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(script)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    result = subprocess.run([*launcher, *args, "--out-dir", str(out)], cwd=work, env=env, capture_output=True,
                            text=True)
    if result.returncode:
        raise SystemExit(f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    losses = re.findall(r"^step (\d+) .*?loss: ([0-9.]+)", result.stdout, flags=re.M)
    payload = torch.load(out / "final.pt", weights_only=True)
    tensors = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()[:16]
               for k, v in sorted(payload["model_state"].items())}
    return {"losses": [float(v) for _, v in losses], "tensors": tensors,
            "model_config": dict(sorted(payload["model_config"].items())),
            "recipe": dict(sorted(payload["meta"]["recipe"].items()))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", help="a fingerprint to compare with; exit 1 on any difference")
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated names of RUNS")
    args = parser.parse_args()
    subprocess.run([sys.executable, str(REPO / "prepare.py"), "setup", "--source", "stdlib"], check=True,
                   stdout=subprocess.DEVNULL)
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs.split(","):
            ranks, run_args, overrides = RUNS[name]
            found[name] = run(name, ranks, run_args, overrides, Path(tmp))
            print(f"{name}: {len(found[name]['losses'])} steps, last loss {found[name]['losses'][-1]}", flush=True)
    Path(args.out).write_text(json.dumps(found, indent=1))
    if not args.compare:
        return 0
    before = json.loads(Path(args.compare).read_text())
    differences = []
    for name, now in found.items():
        for key in ("losses", "tensors", "model_config", "recipe"):
            if now[key] != before[name][key]:
                differences.append(f"{name}: {key} differ")
    print("\n".join(differences) or "identical: every loss, every tensor, the model config and the recipe")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
