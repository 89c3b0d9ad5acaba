"""nanochat's own base_train on the kit's data and tokenizer, scored by the kit's metric.

    python benchmarks/nanochat_peer.py prepare --snapshot nanochat-92d63d4.tar.gz --work WORK
    python benchmarks/nanochat_peer.py train --work WORK --out OUT --seconds 300          # d10, one CUDA GPU
    python prepare.py eval-public --train-py benchmarks/nanochat_adapter.py --checkpoint OUT/final.pt

prepare (any machine, CPU only, no network) unpacks a pinned nanochat snapshot into WORK/nanochat, patches
its scripts/base_train.py (PATCHES below: a --time-budget option), writes stand-in modules (SHIMS below)
into WORK/shims, and writes the kit's tokenizer into nanochat's tokenizer files (WORK/base/tokenizer:
tokenizer.pkl, a pickled tiktoken Encoding, and token_bytes.pt), then checks that nanochat's tokenizer
object gives the kit's ids. WORK stays small (1.3 MB) so it can be copied to another machine.

train links the active dataset's shards into nanochat's data folder (WORK/base/base_data_climbmix: the
train shards, then the public_val shard, which sorts last and so is nanochat's val shard), rewrites and
rechecks the tokenizer files from the kit's pinned tokenizer, runs `python -m scripts.base_train` in
WORK/nanochat with NANOCHAT_BASE_DIR=WORK/base, tees its output to OUT/log.txt, converts its final
checkpoint to OUT/final.pt (format "nanochat-gpt/92d63d4": model_config as plain data + nanochat's state
dict, loadable with torch.load(weights_only=True); benchmarks/nanochat_adapter.py loads it for the
scorer) and writes OUT/summary.json. It exits non-zero with one line `nanochat_peer: error: ...` when
anything fails.

The kit's tokenizer, so that both models see identical tokens and one scorer reads them. nanochat's own
defaults for everything the command line does not name; its periodic evaluations, sampling and wandb off.
--time-budget S (a patch: nanochat has only --num-iterations): after the first --measure-steps timed steps
(20) their mean step time sets num_iterations so that the timed steps add up to about S, and nanochat's
schedules then follow it as if given (the log says ALREADY PASSED if its warmdown would have started
before). A single process (no torchrun).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CHECKPOINT_FORMAT = "nanochat-gpt/92d63d4"  # what benchmarks/nanochat_adapter.py reads
MARKER = "peer.json"  # WORK/peer.json: what prepare did
DATA_DIRNAME = "base_data_climbmix"  # nanochat/dataset.py DATA_DIR under NANOCHAT_BASE_DIR
MODEL_TAG = "peer"  # --model-tag: checkpoints in WORK/base/base_checkpoints/peer
SAMPLE_TEXTS = [
    "Hello world! This is a test.",
    "Numbers: 123, 4567, 89 and 3.14159; dates 2024-01-31.",
    "Contractions: I'm, you're, it's, we'll, they've, she'd",
    "Unicode: 你好世界 🌍 naïve café Ωμέγα",
    "def f(x):\n    return x ** 2  # a comment\n\n\n\tindented\r\n",
    "   leading spaces and <|bos|> written as text, trailing   ",
    "",
]


class PeerError(Exception):
    """A failure with a one-line message."""


# -------------------------------------------------------------------------------------------------
# The patch to nanochat's scripts/base_train.py: (anchor text, replacement). Each anchor must occur
# exactly once in the file, or prepare stops. Applied to the unpacked copy only.
# -------------------------------------------------------------------------------------------------
PATCHED_FILE = "scripts/base_train.py"
PATCHES = [
    (  # 1. the options, beside nanochat's other training-horizon options
        'parser.add_argument("--target-flops", ',
        'parser.add_argument("--time-budget", type=float, default=-1.0, help="(peer patch) training seconds '
        '(total_training_time: the steps after the first 10); num_iterations is set from the mean of the first '
        '--time-budget-measure-steps timed steps (-1 = disable)")\n'
        'parser.add_argument("--time-budget-measure-steps", type=int, default=20, help="(peer patch) timed steps '
        'whose mean step time sets num_iterations under --time-budget")\n'
        'parser.add_argument("--target-flops", ',
    ),
    (  # 2. the decision, right after the step's time is added to total_training_time
        "    if step > 10:\n"
        "        total_training_time += dt # only count the time after the first 10 steps\n",
        "    if step > 10:\n"
        "        total_training_time += dt # only count the time after the first 10 steps\n"
        "    if args.time_budget > 0 and step == 10 + args.time_budget_measure_steps: # (peer patch) --time-budget\n"
        "        mean_dt = total_training_time / args.time_budget_measure_steps\n"
        "        old_warmdown_start = num_iterations - round(args.warmdown_ratio * num_iterations)\n"
        "        num_iterations = max(step + 1, 11 + round(args.time_budget / mean_dt))\n"
        "        warmdown_start = num_iterations - round(args.warmdown_ratio * num_iterations)\n"
        "        passed = step >= min(warmdown_start, old_warmdown_start)\n"
        "        print0(f\"time budget: {args.time_budget:.1f}s at {mean_dt * 1000:.2f}ms/step (mean of steps 11-{step}) \"\n"
        "               f\"=> num_iterations = {num_iterations} ({total_batch_size * num_iterations:,} tokens), \"\n"
        "               f\"warmdown from step {warmdown_start}\" + (\" (ALREADY PASSED: the schedule differs from \"\n"
        "               \"--num-iterations)\" if passed else \"\"))\n",
    ),
]

# -------------------------------------------------------------------------------------------------
# Stand-ins for modules that nanochat imports at module level (base_train and what it imports) but uses
# only on paths this runner never takes. At train time each is put on the PYTHONPATH only when the
# interpreter lacks the real module (the summary lists which); calling one raises a clear error.
# -------------------------------------------------------------------------------------------------
_RAISE = ('def _missing(*args, **kwargs):\n'
          '    raise RuntimeError("{name} is not installed; this stand-in (benchmarks/nanochat_peer.py) only '
          'lets nanochat import it: {why}")\n')
SHIMS = {
    "wandb": ("base_train: `import wandb`, used only when --run is not 'dummy' (the runner passes --run dummy)",
              "init = _missing\n"),
    "rustbpe": ("nanochat/tokenizer.py: `import rustbpe`, used only to train a tokenizer (tok_train); the kit's "
                "tokenizer is written as nanochat's files instead",
                "class Tokenizer:\n    def __init__(self, *args, **kwargs):\n        _missing()\n"),
    "requests": ("nanochat/dataset.py: `import requests`, used only to download shards (the data is linked)",
                 "class RequestException(Exception):\n    pass\n\n\nget = _missing\n"),
    "yaml": ("scripts/base_eval.py (imported by base_train): `import yaml`, used only by the CORE evaluation "
             "(off: --core-metric-every -1)", "safe_load = load = _missing\n"),
    "jinja2": ("nanochat/core_eval.py (through base_eval): `from jinja2 import Template`, used only by the CORE "
               "evaluation (off); usually installed with torch",
               "class Template:\n    def __init__(self, *args, **kwargs):\n        _missing()\n"),
    "filelock": ("nanochat/common.py: `from filelock import FileLock`, used only to download the CORE bundle "
                 "(off); usually installed with torch",
                 "class FileLock:\n    def __init__(self, *args, **kwargs):\n        _missing()\n"),
}


def shim_source(name: str) -> str:
    why, body = SHIMS[name]
    return (f'"""Stand-in for {name} written by benchmarks/nanochat_peer.py: {why}."""\n'
            "__peer_stand_in__ = True\n\n\n" + _RAISE.format(name=name, why=why.replace('"', "'")) + "\n\n" + body)


def fail(message: str):
    raise PeerError(message)


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


# -------------------------------------------------------------------------------------------------
# prepare
# -------------------------------------------------------------------------------------------------

def unpack(snapshot: Path, work: Path) -> str:
    """Unpack the tarball's single top folder (nanochat-<commit>) as work/nanochat; returns the commit."""
    if not snapshot.is_file():
        fail(f"--snapshot {snapshot}: no such file")
    with tarfile.open(snapshot) as tar:
        members = tar.getmembers()
        tops = {m.name.split("/", 1)[0] for m in members}
        if len(tops) != 1:
            fail(f"{snapshot} holds {sorted(tops)[:5]} at its top; expected one folder nanochat-<commit>")
        top = tops.pop()
        m = re.fullmatch(r"nanochat-([0-9a-f]{7,40})", top)
        if not m:
            fail(f"{snapshot}: top folder {top!r} is not nanochat-<commit>")
        staging = work / ".unpack.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        for member in members:
            if not (member.isfile() or member.isdir()):
                fail(f"{snapshot}: {member.name} is not a plain file or folder")
        try:
            tar.extractall(staging, filter="data")
        except TypeError:  # Python without extraction filters (checked above: files and folders only)
            tar.extractall(staging)
    dest = work / "nanochat"
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(staging / top, dest)
    staging.rmdir()
    return m.group(1)


def apply_patches(nanochat: Path) -> list[dict]:
    path = nanochat / PATCHED_FILE
    text = path.read_text()
    if "(peer patch)" in text:
        fail(f"{path} is already patched")
    done = []
    for i, (anchor, replacement) in enumerate(PATCHES, 1):
        count = text.count(anchor)
        if count != 1:
            fail(f"patch {i} to {PATCHED_FILE}: its anchor occurs {count} times (expected once); this snapshot is "
                 f"not the one the patch was written for. Anchor: {anchor.splitlines()[0]!r}")
        text = text.replace(anchor, replacement)
        done.append({"anchor": anchor.splitlines()[0].strip(), "lines_added": replacement.count("\n") - anchor.count("\n")})
    path.write_text(text)
    compile(text, str(path), "exec")  # the patched file still parses
    return done


def write_shims(work: Path) -> None:
    folder = work / "shims"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for name in SHIMS:
        source = shim_source(name)
        compile(source, name, "exec")
        (folder / f"{name}.py").write_text(source)


def activate_shims(work: Path) -> list[str]:
    """work/active_shims holds the stand-ins for the modules this interpreter lacks; returns their names."""
    active = work / "active_shims"
    shutil.rmtree(active, ignore_errors=True)
    active.mkdir()
    used = []
    for name in SHIMS:
        try:
            missing = importlib.util.find_spec(name) is None
        except (ImportError, ValueError):  # a broken installation counts as missing
            missing = True
        if missing:
            shutil.copyfile(work / "shims" / f"{name}.py", active / f"{name}.py")
            used.append(name)
    return used


def write_tokenizer(base: Path) -> dict:
    """The kit's pinned tokenizer (the active dataset's) as nanochat's tokenizer files."""
    import torch
    from harness.tokenizer import ensure_tokenizer, get_token_bytes
    tok = ensure_tokenizer()
    folder = base / "tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    data = pickle.dumps(tok.enc)  # a tiktoken Encoding pickles as its name, pattern, ranks and special tokens
    if pickle.loads(data).encode_ordinary(SAMPLE_TEXTS[3]) != tok.enc.encode_ordinary(SAMPLE_TEXTS[3]):
        fail("the pickled tokenizer does not round-trip")
    tmp = folder / "tokenizer.pkl.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, folder / "tokenizer.pkl")
    token_bytes = get_token_bytes("cpu", tok).to(torch.int32).clone()
    torch.save(token_bytes, folder / "token_bytes.pt.tmp")
    os.replace(folder / "token_bytes.pt.tmp", folder / "token_bytes.pt")
    return {"name": tok.name, "path": str(tok.path), "sha256": tok.sha256, "vocab_size": tok.get_vocab_size(),
            "bos_id": tok.get_bos_token_id()}


def nanochat_dtype(device: str, dtype: str) -> str:
    """NANOCHAT_DTYPE for --dtype: auto is the kit's choice for its preset on this device (bf16 on a GPU; on a CPU
    the faster of bf16 and fp32 as train.py measures the cpu preset's matmuls)."""
    if dtype == "auto":
        sys.path.insert(0, str(REPO))
        import train
        recipe = train.parse_command_line(["--preset", "cpu" if device == "cpu" else "gpu"])[0]
        dtype = train.dtype_name(train.device_profile_for(recipe, device).compute_dtype)
    return {"bf16": "bfloat16", "fp32": "float32"}[dtype]


def nanochat_env(work: Path, device: str, dtype: str = "auto") -> dict:
    env = dict(os.environ)
    env["NANOCHAT_BASE_DIR"] = str(work / "base")
    env["NANOCHAT_DTYPE"] = nanochat_dtype(device, dtype)
    env["PYTHONPATH"] = os.pathsep.join([str(work / "active_shims")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("WANDB_MODE", None)
    return env


_CHECK_SNIPPET = r"""
import json, os, sys
from nanochat.tokenizer import get_tokenizer, get_token_bytes, SPECIAL_TOKENS
texts = json.loads(sys.stdin.read())
t = get_tokenizer()
out = {"vocab": t.get_vocab_size(), "bos": t.get_bos_token_id(),
       "specials": {s: t.encode_special(s) for s in SPECIAL_TOKENS},
       "one": [t.encode(x) for x in texts], "batch_bos": t.encode(texts, prepend="<|bos|>", num_threads=2),
       "batch_id": t.encode(texts, prepend=t.get_bos_token_id(), num_threads=2),
       "decoded": [t.decode(t.encode(x)) for x in texts], "token_bytes": get_token_bytes().tolist()}
if os.environ.get("PEER_CHECK_DATA"):
    from nanochat.dataset import list_parquet_files
    out["parquet"] = [os.path.realpath(p) for p in list_parquet_files()]
print("PEER_CHECK " + json.dumps(out))
"""


def check_tokenizer(work: Path, texts: list[str], expect_files: list[str] | None = None) -> dict:
    """nanochat's own tokenizer object (imported from the unpacked copy, with this run's stand-ins) must
    give the kit's ids, special-token ids and token byte lengths; with expect_files, nanochat's parquet
    list must be those files in that order (the last one is its val shard)."""
    from harness.tokenizer import ensure_tokenizer, get_token_bytes
    from harness.config import SPECIAL_TOKENS
    kit = ensure_tokenizer()
    env = nanochat_env(work, "cpu", "fp32")
    if expect_files is not None:
        env["PEER_CHECK_DATA"] = "1"
    proc = subprocess.run([sys.executable, "-c", _CHECK_SNIPPET], cwd=work / "nanochat", env=env,
                          input=json.dumps(texts), capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PEER_CHECK ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        fail(f"importing nanochat's tokenizer failed (exit {proc.returncode}): {tail}")
    got = json.loads(lines[-1][len("PEER_CHECK "):])
    bos = kit.get_bos_token_id()
    problems = []
    if got["vocab"] != kit.get_vocab_size():
        problems.append(f"vocab {got['vocab']} != {kit.get_vocab_size()}")
    if got["bos"] != bos:
        problems.append(f"BOS {got['bos']} != {bos}")
    want_specials = {s: kit.encode_special(s) for s in SPECIAL_TOKENS}
    if got["specials"] != want_specials:
        problems.append(f"special tokens {got['specials']} != {want_specials}")
    if got["one"] != [kit.encode(x) for x in texts]:
        problems.append("ids of single texts differ")
    want_batch = kit.encode(texts, prepend=bos)
    if got["batch_bos"] != want_batch or got["batch_id"] != want_batch:
        problems.append("ids of a BOS-prepended batch differ")
    if got["decoded"] != texts:
        problems.append("decode(encode(text)) != text")
    if got["token_bytes"] != get_token_bytes("cpu", kit).tolist():
        problems.append("token byte lengths differ")
    if expect_files is not None and got["parquet"] != expect_files:
        problems.append(f"nanochat lists parquet files {got['parquet']}, expected {expect_files}")
    if problems:
        fail("nanochat's tokenizer/data do not match the kit's: " + "; ".join(problems))
    return {"texts": len(texts), "tokens": sum(len(x) for x in want_batch), "bos_id": bos,
            "specials": want_specials, "parquet_files": len(got.get("parquet", []))}


def check_texts() -> list[str]:
    """Fixed texts plus the first documents of the public_val shard and of the first train shard."""
    import pyarrow.parquet as pq
    from harness.data import split_shards
    texts = list(SAMPLE_TEXTS)
    for split in ("public_val", "train"):
        pf = pq.ParquetFile(split_shards(split)[0])
        texts += [doc[:3000] for doc in pf.read_row_group(0, columns=["text"]).column("text").to_pylist()[:4]]
    return texts


def cmd_prepare(args) -> None:
    work = Path(args.work).resolve()
    snapshot = Path(args.snapshot).resolve()
    if work.exists() and any(work.iterdir()) and not (work / MARKER).exists():
        fail(f"--work {work} exists, is not empty and was not made by this script ({MARKER} is missing); "
             "pass a new or empty folder")
    if not snapshot.is_file():
        fail(f"--snapshot {snapshot}: no such file")
    work.mkdir(parents=True, exist_ok=True)
    write_json(work / MARKER, {"state": "incomplete: prepare did not finish"})  # a rerun may reuse the folder
    commit = unpack(snapshot, work)
    patches = apply_patches(work / "nanochat")
    write_shims(work)
    used = activate_shims(work)
    (work / "base").mkdir(exist_ok=True)
    tokenizer = write_tokenizer(work / "base")
    texts = check_texts()
    check = check_tokenizer(work, texts)
    shutil.rmtree(work / "nanochat" / "__pycache__", ignore_errors=True)
    for cache in (work / "nanochat").rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)
    from harness.common import sha256_file
    marker = {"nanochat_commit": commit, "snapshot": snapshot.name, "snapshot_sha256": sha256_file(snapshot),
              "patched_file": PATCHED_FILE, "patches": patches, "shims": {k: v[0] for k, v in SHIMS.items()},
              "tokenizer": tokenizer, "tokenizer_check": check, "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    write_json(work / MARKER, marker)
    size = dir_size(work)
    print(f"nanochat {commit} unpacked to {work / 'nanochat'} and patched ({len(patches)} patches to {PATCHED_FILE})")
    print(f"stand-ins written to {work / 'shims'}: {', '.join(SHIMS)} (missing here, so active: {', '.join(used) or 'none'})")
    print(f"tokenizer {tokenizer['name']} (sha256 {tokenizer['sha256'][:16]}...) written to {work / 'base' / 'tokenizer'}; "
          f"nanochat's tokenizer gives the kit's ids on {check['texts']} texts ({check['tokens']} tokens), "
          f"BOS {check['bos_id']}, same token byte lengths")
    print(f"work folder size: {size / 1e6:.2f} MB")


# -------------------------------------------------------------------------------------------------
# train
# -------------------------------------------------------------------------------------------------

def link_data(base: Path) -> dict:
    """nanochat's data folder: links to the active dataset's train shards, then its public_val shard,
    named so that it sorts last (nanochat/dataset.py: the last parquet file is the val split)."""
    from harness.data import active_dataset_dir, split_shards
    dataset = active_dataset_dir()
    train, val = split_shards("train", dataset), split_shards("public_val", dataset)
    if len(val) != 1:
        fail(f"the active dataset {dataset} has {len(val)} public_val shards; nanochat takes exactly one val shard")
    folder = base / DATA_DIRNAME
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        fail(f"{folder} is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    for entry in folder.iterdir():
        if not entry.is_symlink():
            fail(f"{folder} holds {entry.name}, which is not a link this script made; move it away")
        entry.unlink()
    names = [p.name for p in train]
    val_name = val[0].name if all(val[0].name > n for n in names) else f"zz_public_val_{val[0].name}"
    for p in train:
        (folder / p.name).symlink_to(p.resolve())
    (folder / val_name).symlink_to(val[0].resolve())
    return {"dataset_dir": str(dataset), "train_shards": len(train), "public_val_shard": str(val[0]),
            "linked_as": str(folder), "expect": [str(p.resolve()) for p in train] + [str(val[0].resolve())]}


STEP_LINE = re.compile(r"^step (\d+)/(\d+) \(([\d.]+)%\) \| loss: ([\d.eE+-]+|nan|inf) \| lrm: ([\d.]+) \| "
                       r"dt: ([\d.]+)ms \| tok/sec: ([\d,]+) \| bf16_mfu: ([\d.]+|inf|nan)")


def parse_log(lines: list[str], tokens_per_step: int) -> dict:
    steps = []
    found: dict = {}
    for line in lines:
        m = STEP_LINE.match(line)
        if m:
            steps.append({"step": int(m.group(1)), "num_iterations": int(m.group(2)), "loss": float(m.group(4)),
                          "lrm": float(m.group(5)), "dt_s": float(m.group(6)) / 1000, "mfu": float(m.group(8))})
            continue
        for key, pattern in (("peak_memory_mib", r"^Peak memory usage: ([\d.]+)MiB"),
                             ("num_params", r"^total\s*: ([\d,]+)$"),
                             ("flops_per_token", r"^Estimated FLOPs per token: ([\d.eE+-]+)"),
                             ("compute_dtype", r"^COMPUTE_DTYPE: (.*)$"),
                             ("gpu", r"^GPU: (.*?) \| Peak FLOPS"),
                             ("grad_accum_steps", r"^Total batch size [\d,]+ => gradient accumulation steps: (\d+)"),
                             ("time_budget_line", r"^(time budget: .*)$"),
                             ("total_training_time_line", r"^Total training time: (.*)$"),
                             ("attention_fa3", r"^(✓ Using Flash Attention 3.*)$"),
                             ("attention_sdpa", r"^WARNING: (Flash Attention 3 .*)$"),
                             ("sliding_window_warning", r"^WARNING: (SDPA has no support for sliding window.*)$"),
                             ("window_pattern", r'^\s*"window_pattern": "(\w+)"')):
            m = re.match(pattern, line)
            if m and key not in found:
                found[key] = m.group(1)
    out: dict = {"steps": len(steps)}
    for key in ("num_params", "grad_accum_steps"):
        if key in found:
            out[key] = int(found[key].replace(",", ""))
    for key in ("peak_memory_mib", "flops_per_token"):
        if key in found:
            out[key] = float(found[key])
    for key in ("compute_dtype", "gpu", "time_budget_line", "total_training_time_line", "window_pattern",
                "sliding_window_warning"):
        if key in found:
            out[key] = found[key]
    if "attention_fa3" in found:
        out["attention"] = "flash-attention-3 (kernels package)"
    elif "attention_sdpa" in found:
        out["attention"] = "torch SDPA (nanochat's fallback: " + found["attention_sdpa"] + ")"
    if steps:
        timed = [s for s in steps if s["step"] > 10] or steps[1:] or steps
        out["training_seconds"] = sum(s["dt_s"] for s in steps if s["step"] > 10)
        out["steady_steps"] = len(timed)
        out["steady_step_seconds_mean"] = sum(s["dt_s"] for s in timed) / len(timed)
        out["tokens_per_second"] = tokens_per_step * len(timed) / sum(s["dt_s"] for s in timed)
        out["mfu_percent_mean"] = sum(s["mfu"] for s in timed) / len(timed)
        out["first_step_dt_s"] = steps[0]["dt_s"]
        out["first_11_steps_dt_s"] = sum(s["dt_s"] for s in steps if s["step"] <= 10)
        out["final_num_iterations"] = steps[-1]["num_iterations"]
        out["final_smoothed_train_loss"] = steps[-1]["loss"]
        out["tokens"] = tokens_per_step * len(steps)
    return out


def run_logged(cmd: list[str], cwd: Path, env: dict, log_path: Path, wall_limit: float) -> dict:
    """Run cmd in a process group of its own, copying its output to stdout and log_path, with the time
    of the step-0 and step-10 lines. The wall time is the main process's; once it has exited, what is
    left of its group (compile workers that hold the pipe) gets 10 s to finish and is then ended."""
    t0 = time.monotonic()
    marks: dict = {}
    lines: list[str] = []
    killed = {"why": None}
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, encoding="utf-8", errors="replace", bufsize=1, start_new_session=True)

        def signal_group(sig) -> None:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

        def stop(why: str) -> None:
            killed["why"] = why
            signal_group(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
            signal_group(signal.SIGKILL)

        def read() -> None:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log.write(line)
                log.flush()
                line = line.rstrip("\n")
                lines.append(line)
                m = STEP_LINE.match(line)
                if m and int(m.group(1)) in (0, 10) and f"step_{int(m.group(1))}" not in marks:
                    marks[f"step_{int(m.group(1))}"] = time.monotonic() - t0

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        timer = threading.Timer(wall_limit, stop, args=(f"ran past --wall-limit {wall_limit:.0f}s",)) \
            if wall_limit > 0 else None
        if timer:
            timer.daemon = True
            timer.start()
        try:
            rc = proc.wait()
            wall = time.monotonic() - t0
            reader.join(timeout=10)
            if reader.is_alive():  # something the run started still holds the pipe
                signal_group(signal.SIGKILL)
                reader.join(timeout=10)
        except KeyboardInterrupt:
            stop("interrupted")
            raise
        finally:
            if timer:
                timer.cancel()
    return {"rc": rc, "wall_seconds": wall, "lines": list(lines), "marks": marks, "killed": killed["why"]}


def convert_checkpoint(checkpoints: Path, out: Path, extra_meta: dict) -> dict:
    """nanochat's last checkpoint (model_NNNNNN.pt + meta_NNNNNN.json) as out: the adapter's format."""
    import torch
    found = sorted((int(m.group(1)), p) for p in checkpoints.glob("model_*.pt")
                   if (m := re.fullmatch(r"model_(\d+)\.pt", p.name)))
    if not found:
        fail(f"nanochat wrote no checkpoint in {checkpoints}")
    step, model_path = found[-1]
    meta = json.loads((checkpoints / f"meta_{step:06d}.json").read_text())
    state = torch.load(model_path, map_location="cpu", weights_only=True)
    state = {k.removeprefix("_orig_mod."): v.detach().cpu().contiguous() for k, v in state.items()}
    payload = {"format": CHECKPOINT_FORMAT, "model_config": dict(meta["model_config"]), "model_state": state,
               "meta": {**extra_meta, "step": step, "nanochat_meta": {k: meta[k] for k in meta
                                                                      if k not in ("model_config",)}}}
    tmp = out.with_name(out.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, out)
    back = torch.load(out, map_location="cpu", weights_only=True)  # the scorer's way: plain data only
    if set(back["model_state"]) != set(state):
        fail(f"{out} does not read back")
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in state.values()})
    return {"step": step, "model_config": payload["model_config"], "bytes": out.stat().st_size,
            "state_dtypes": dtypes, "meta_json": meta}


def cmd_train(args) -> None:
    import torch
    work = Path(args.work).resolve()
    out = Path(args.out).resolve()
    marker_path = work / MARKER
    if not marker_path.exists() or not (work / "nanochat" / PATCHED_FILE).exists():
        fail(f"--work {work} is not prepared (no {MARKER} or nanochat/): run `nanochat_peer.py prepare` first")
    marker = json.loads(marker_path.read_text())
    if "nanochat_commit" not in marker:
        fail(f"--work {work}: prepare did not finish there; run it again")
    if "--time-budget" not in (work / "nanochat" / PATCHED_FILE).read_text():
        fail(f"{work / 'nanochat' / PATCHED_FILE} is not patched: run prepare again")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda, but torch sees no CUDA device (torch " + torch.__version__ + ")")
    if args.seconds <= 0:
        fail("--seconds must be positive")
    tokens_per_micro = args.device_batch_size * args.seq_len
    if args.total_batch_size % tokens_per_micro:
        fail(f"--total-batch-size {args.total_batch_size} is not a multiple of device batch x sequence "
             f"({args.device_batch_size} x {args.seq_len} = {tokens_per_micro})")
    out.mkdir(parents=True, exist_ok=True)
    base = work / "base"
    data = link_data(base)
    tokenizer = write_tokenizer(base)
    if tokenizer["sha256"] != marker["tokenizer"]["sha256"]:
        print(f"note: the active dataset's tokenizer ({tokenizer['name']}, {tokenizer['sha256'][:16]}...) is not the one "
              f"prepare wrote ({marker['tokenizer']['name']}); nanochat's tokenizer files were rewritten from it")
    used = activate_shims(work)
    check = check_tokenizer(work, check_texts(), expect_files=data.pop("expect"))
    checkpoints = base / "base_checkpoints" / MODEL_TAG
    shutil.rmtree(checkpoints, ignore_errors=True)
    cmd = [sys.executable, "-m", "scripts.base_train",
           "--device-type", args.device, "--depth", str(args.depth), "--max-seq-len", str(args.seq_len),
           "--device-batch-size", str(args.device_batch_size), "--total-batch-size", str(args.total_batch_size),
           "--time-budget", str(args.seconds), "--time-budget-measure-steps", str(args.measure_steps),
           "--run", "dummy", "--eval-every", "-1", "--core-metric-every", "-1", "--sample-every", "-1",
           "--model-tag", MODEL_TAG, *args.extra]
    env = nanochat_env(work, args.device, args.dtype)
    if args.no_compile:
        env["TORCHDYNAMO_DISABLE"] = "1"  # torch's own switch: every torch.compile runs eagerly
    shown_env = {k: env[k] for k in ("NANOCHAT_BASE_DIR", "NANOCHAT_DTYPE", "PYTHONPATH", "TORCHDYNAMO_DISABLE")
                 if k in env}
    print(f"[peer] cd {work / 'nanochat'} && " + " ".join(f"{k}={v}" for k, v in shown_env.items()) + " "
          + " ".join(cmd), flush=True)
    (out / "summary.json").unlink(missing_ok=True)
    run = run_logged(cmd, work / "nanochat", env, out / "log.txt", args.wall_limit)
    parsed = parse_log(run["lines"], args.total_batch_size)
    problem = None
    if run["killed"]:
        problem = f"nanochat's base_train {run['killed']} and was stopped"
    elif run["rc"] != 0:
        last = next((ln for ln in reversed(run["lines"]) if ln.strip()), "(no output)")
        problem = f"nanochat's base_train exited with {run['rc']}: {last.strip()[:300]}"
    elif not parsed["steps"]:
        problem = "nanochat's base_train logged no training step"
    elif "time_budget_line" not in parsed:
        problem = (f"nanochat's base_train ended after {parsed['steps']} steps, before the --time-budget decision "
                   f"at step {10 + args.measure_steps} (its default horizon was shorter)")
    if problem:  # what the log says so far, for a run that cannot be repeated at once
        write_json(out / "summary.json", {"failed": problem, "wall_seconds": run["wall_seconds"],
                                          "marks": run["marks"], "stand_ins_used": used, "command": cmd, **parsed})
        fail(f"{problem} (log: {out / 'log.txt'}, partial summary: {out / 'summary.json'})")
    run_meta = {"nanochat_commit": marker["nanochat_commit"], "snapshot_sha256": marker["snapshot_sha256"],
                "tokenizer_sha256": tokenizer["sha256"], "command": cmd}
    ckpt = convert_checkpoint(checkpoints, out / "final.pt", run_meta)
    (out / "nanochat_meta.json").write_text(json.dumps(ckpt.pop("meta_json"), indent=2) + "\n")
    if not args.keep_raw:
        shutil.rmtree(checkpoints, ignore_errors=True)  # model, optimizer and meta: final.pt holds the model
    summary = {
        "nanochat_commit": marker["nanochat_commit"],
        "snapshot": marker["snapshot"], "snapshot_sha256": marker["snapshot_sha256"],
        "device": args.device, "compiled": not args.no_compile, "gpu": parsed.get("gpu"), "torch": torch.__version__,
        "python": sys.version.split()[0],
        "depth": args.depth, "seq_len": args.seq_len, "device_batch_size": args.device_batch_size,
        "tokens_per_step": args.total_batch_size, "grad_accum_steps": parsed.get("grad_accum_steps"),
        "time_budget_seconds": args.seconds, "time_budget_line": parsed.get("time_budget_line"),
        "steps": parsed["steps"], "num_iterations": parsed.get("final_num_iterations"),
        "tokens": parsed.get("tokens"),
        "training_seconds": parsed.get("training_seconds"),
        "training_seconds_rule": "nanochat's total_training_time: the sum of the logged dt of steps 11 and later",
        "nanochat_total_training_time": parsed.get("total_training_time_line"),
        "tokens_per_second": parsed.get("tokens_per_second"),
        "tokens_per_second_rule": "tokens per step x steady steps / their summed dt (steps 11 and later)",
        "steady_step_seconds_mean": parsed.get("steady_step_seconds_mean"),
        "mfu_percent_mean": parsed.get("mfu_percent_mean"),
        "wall_seconds": run["wall_seconds"],
        "seconds_to_step_0_logged": run["marks"].get("step_0"),
        "seconds_to_step_10_logged": run["marks"].get("step_10"),
        "first_step_dt_s": parsed.get("first_step_dt_s"),
        "first_11_steps_dt_s": parsed.get("first_11_steps_dt_s"),
        "peak_memory_mib": parsed.get("peak_memory_mib"),
        "num_params": parsed.get("num_params"), "flops_per_token": parsed.get("flops_per_token"),
        "compute_dtype": parsed.get("compute_dtype"),
        "attention": parsed.get("attention"), "window_pattern": parsed.get("window_pattern"),
        "sliding_window_warning": parsed.get("sliding_window_warning"),
        "final_smoothed_train_loss": parsed.get("final_smoothed_train_loss"),
        "checkpoint": {"path": str(out / "final.pt"), **ckpt},
        "stand_ins_used": used,
        "tokenizer": tokenizer, "tokenizer_check": check, "data": data,
        "command": cmd, "cwd": str(work / "nanochat"), "env": shown_env,
        "log": str(out / "log.txt"),
    }
    write_json(out / "summary.json", summary)
    print(f"[peer] {parsed['steps']} steps, {summary['tokens_per_second'] or 0:,.0f} tok/s steady, "
          f"{summary['training_seconds'] or 0:.1f}s training, {run['wall_seconds']:.1f}s wall; "
          f"attention: {summary['attention']}; wrote {out / 'final.pt'} and {out / 'summary.json'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="unpack, patch and set up nanochat in --work (CPU, no network)")
    p.add_argument("--snapshot", required=True, help="the nanochat tarball (nanochat-<commit>.tar.gz)")
    p.add_argument("--work", required=True, help="the work folder (created; small, copy it to the GPU machine)")
    t = sub.add_parser("train", help="run nanochat's base_train for a training time and convert its checkpoint")
    t.add_argument("--work", required=True)
    t.add_argument("--out", required=True, help="folder for log.txt, final.pt, summary.json")
    t.add_argument("--seconds", type=float, required=True, help="training time (nanochat's total_training_time)")
    t.add_argument("--depth", type=int, default=10)
    t.add_argument("--seq-len", type=int, default=2048)
    t.add_argument("--device-batch-size", type=int, default=32)
    t.add_argument("--total-batch-size", type=int, default=262144)
    t.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    t.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="nanochat's compute dtype (NANOCHAT_DTYPE); auto: the kit's --dtype auto for the device")
    t.add_argument("--measure-steps", type=int, default=20, help="timed steps whose mean sets num_iterations")
    t.add_argument("--wall-limit", type=float, default=0, help="stop base_train after this many wall seconds "
                   "(0: no limit); a stopped run is an error")
    t.add_argument("--no-compile", action="store_true", help="run nanochat's torch.compile calls eagerly "
                   "(TORCHDYNAMO_DISABLE=1): for quick CPU rehearsals, not for measurements")
    t.add_argument("--keep-raw", action="store_true", help="keep nanochat's own checkpoint files in --work")
    t.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more base_train flags, last on the line "
                   "(e.g. --extra --window-pattern L)")
    args = parser.parse_args(argv)
    try:
        (cmd_prepare if args.cmd == "prepare" else cmd_train)(args)
    except PeerError as e:
        print(f"nanochat_peer: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # one clear line for anything else too (the traceback would bury it)
        print(f"nanochat_peer: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
