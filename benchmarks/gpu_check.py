"""The kit on one CUDA GPU, measured in one command: the environment, the measured bf16 matmul peak, d10
(the organisers' shape) and `--preset gpu` each trained for the same wall time with tokens/s, MFU against
the measured peak, peak memory, start-up (compile) time and the loss curve, each checkpoint scored by
`prepare.py eval-public` through the contained worker, CORE of the d10 checkpoint on a small bundle with
the honest-vs-trusted differences of its bf16 model, nanochat at the d10 shape for the same wall time on the
same GPU scored by the same command, the window layers' attention (dense mask against FlexAttention),
and benchmarks/check_tolerances.py on the d10 checkpoint on the GPU.

    python benchmarks/gpu_check.py prepare [--nanochat-snapshot nanochat-92d63d4.tar.gz]   # here, CPU: data
    python benchmarks/gpu_check.py run --out benchmarks/results/gpu      # on the GPU (see below for how long)
    python benchmarks/gpu_check.py run --rehearsal --out /tmp/rehearsal  # every stage, tiny, on a CPU

`prepare` builds the text the GPU trains on (no network there: Python source, this interpreter's standard library
and the venv's larger packages, sharded with the shipped stdlib tokenizer into .gpu/data, ~41 MB) and, given the
snapshot, nanochat's runner (.gpu/nanochat). `run` copies the data out of the repository (so the contained worker
cannot read it and the evaluation can be official), runs the stages in order within --deadline seconds, skipping
a stage that no longer fits, and writes <out>/<stamp>.json and .md after every stage; `--only STAGES --merge
EARLIER.json` reruns some into an earlier result. On one H200 a run of the kit takes 4-5 minutes at --seconds 40,
so a 15-minute lease splits the stages into two calls. Training and scoring use the kit's own command lines."""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

GPU_DIR = REPO / ".gpu"  # ignored by git: what `prepare` builds for the GPU machine
CORPUS_PACKAGES = ("torch", "numpy", "matplotlib", "networkx", "pip", "pygments", "pyarrow", "setuptools")
# In the order of what a lease must show first: the sandbox, d10 scored officially on the GPU, nanochat at d10
# for the same wall time; then CORE, the honest differences at official probe counts, the attention stage, and
# --preset gpu with nanochat at its shape.
STAGES = ("environment", "peak", "sandbox", "d10", "nanochat", "core", "tolerances", "attention", "gpu",
          "nanochat_gpu")
# Seconds a stage needs beyond its training time (imports, compile, save, the contained evaluation): a stage
# that no longer fits before the deadline is skipped, and says so.
# Measured on an H200 (benchmarks/results/gpu): a cold compile of 63-71 s, the save, and eval-public's 53 s.
OVERHEAD_SECONDS = {"environment": 15, "peak": 20, "sandbox": 30, "d10": 170, "gpu": 170, "nanochat": 170,
                    "nanochat_gpu": 170, "core": 90, "attention": 60, "tolerances": 120}
TRAINED = {"d10": "train.py", "gpu": "train.py", "nanochat": "benchmarks/nanochat_adapter.py",
           "nanochat_gpu": "benchmarks/nanochat_adapter.py"}
# nanochat's shape for each kit run it stands beside. The kit's d10 is full context in every layer; the preset's
# windows (SSSL) run on FlexAttention, but nanochat's need Flash Attention 3, which it fetches from the network,
# and without it run on SDPA's slow dense-mask path: nanochat runs full context ("L") at both shapes.
NANOCHAT_SHAPES = {"nanochat": ["--depth", "10", "--seq-len", "2048", "--device-batch-size", "32",
                                "--total-batch-size", "262144"],
                   "nanochat_gpu": ["--depth", "8", "--seq-len", "2048", "--device-batch-size", "32",
                                    "--total-batch-size", "262144"]}
BUNDLE_EXAMPLES = 24  # per task: more than the most shots (10), so every example has its few-shot examples
# --rehearsal: every stage at sizes a 2-core CPU runs in seconds
TINY = ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--seq-len", "128", "--device-batch-size", "4",
        "--total-batch-size", "1024", "--no-compile", "--device", "cpu", "--log-every", "1"]


# -----------------------------------------------------------------------------------------------
# prepare (here, on a CPU)
# -----------------------------------------------------------------------------------------------

def python_corpus(out: Path) -> tuple[int, int]:
    """This interpreter's standard library and CORPUS_PACKAGES' .py files as .txt files under out."""
    import sysconfig
    roots = {"stdlib": Path(sysconfig.get_paths()["stdlib"])}
    site = Path(sysconfig.get_paths()["purelib"])
    roots.update({name: site / name for name in CORPUS_PACKAGES if (site / name).is_dir()})
    files = chars = 0
    for name, root in roots.items():
        for f in sorted(root.rglob("*.py")):
            if "site-packages" in f.relative_to(root).parts:
                continue
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                target = out / name / (str(f.relative_to(root)).replace("/", "__") + ".txt")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text, encoding="utf-8")
                files, chars = files + 1, chars + len(text)
    return files, chars


def cmd_prepare(args) -> int:
    GPU_DIR.mkdir(exist_ok=True)
    text = GPU_DIR / "text"
    shutil.rmtree(text, ignore_errors=True)
    files, chars = python_corpus(text)
    print(f"[prepare] {files} files, {chars / 1e6:.1f}M characters of Python source")
    env = dict(os.environ, FRONTIER_CACHE_DIR=str(GPU_DIR / "cache"))
    subprocess.run([sys.executable, "prepare.py", "setup", "--source", f"dir:{text}", "--tokenizer", "stdlib",
                    "--data-dir", str(GPU_DIR / "data")], cwd=REPO, env=env, check=True)
    shutil.rmtree(text)
    if args.nanochat_snapshot:
        subprocess.run([sys.executable, "benchmarks/nanochat_peer.py", "prepare", "--snapshot",
                        args.nanochat_snapshot, "--work", str(GPU_DIR / "nanochat")], cwd=REPO, env=env, check=True)
    print("[prepare] done: carry .gpu/data" + (" and .gpu/nanochat" if args.nanochat_snapshot else ""))
    return 0


# -----------------------------------------------------------------------------------------------
# In-process measurements, each in a process of its own (`stage NAME`): the driver never touches the GPU
# -----------------------------------------------------------------------------------------------

def stage_environment(device: str) -> dict:
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "kernel": platform.release(), "cpus": os.cpu_count(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            info["driver"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            info["driver"] = f"unknown ({e})"
    return info


def measure_cuda_flops(n: int = 8192, warmup: int = 3, repeats: int = 10) -> float:
    """The bf16 matmul FLOP/s of this GPU, after warm-up calls that choose kernels and raise the clocks."""
    import torch
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(warmup):
        a @ a
    seconds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ a
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1000)
    return 2 * n**3 / sorted(seconds)[len(seconds) // 2]


def stage_peak(device: str) -> dict:
    import train as T
    if device == "cuda":
        flops = [measure_cuda_flops() for _ in range(3)]
        return {"tflops": sorted(flops)[1] / 1e12, "tflops_runs": [f / 1e12 for f in flops],
                "how": "bf16 8192^3 matmul, median of 10 after 3 warm-ups; median of 3 runs"}
    profile = T.device_profile_for(T.parse_command_line(["--preset", "cpu"])[0], "cpu")  # (the rehearsal)
    return {"tflops": profile.peak_flops / 1e12, "how": f"train.device_profile_for, cpu preset ({profile.peak_source})"}


def stage_attention(device: str, rehearsal: bool) -> dict:
    """A window layer's attention at the gpu preset's shape (rows of 2,048, windows of 512, 4 heads of 128, 32
    rows), compiled: SDPA with the dense boolean mask (what the model ran before FlexAttention), FlexAttention
    with the block mask (what it runs now on a compiled CUDA model), and plain causal SDPA (flash) as the floor.
    Forward and backward on CUDA; forward only on a CPU (FlexAttention has no CPU backward)."""
    import torch
    import torch.nn.functional as F
    import train as T
    B, H, L, D, W = (2, 2, 64, 32, 16) if rehearsal else (32, 4, 2048, 128, 512)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    backward = device == "cuda"
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device=device, dtype=dtype, requires_grad=backward) for _ in range(3))
    pos = torch.arange(L, device=device)
    dense = ((pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < W))[None, None]
    block = T.sliding_window_block_mask(L, W, torch.device(device))
    compile_ = (lambda f: torch.compile(f, dynamic=False)) if device == "cuda" else (lambda f: f)
    variants = {"sdpa_dense_mask": compile_(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)),
                "flex_block_mask": compile_(lambda q, k, v: T.flex_attention(q, k, v, block_mask=block)),
                "sdpa_causal_full": compile_(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))}
    out, result = {}, {"shape": f"B{B} H{H} T{L} D{D} window {W}, {str(dtype).replace('torch.', '')}",
                       "pass": "forward + backward" if backward else "forward"}
    grad = torch.randn(B, H, L, D, device=device, dtype=dtype)
    for name, f in variants.items():
        def once():
            y = f(q, k, v)
            if backward:
                y.backward(grad)
            return y
        t0 = time.perf_counter()
        out[name] = once().detach().float()
        if device == "cuda":
            torch.cuda.synchronize()
        result[f"{name}_first_call_s"] = round(time.perf_counter() - t0, 2)
        times = []
        for _ in range(3 if rehearsal else 20):
            t0 = time.perf_counter()
            once()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        result[f"{name}_ms"] = round(1000 * sorted(times)[len(times) // 2], 3)
    result["flex_vs_dense_max_abs_diff"] = float((out["flex_block_mask"] - out["sdpa_dense_mask"]).abs().max())
    result["dense_over_flex"] = round(result["sdpa_dense_mask_ms"] / result["flex_block_mask_ms"], 2)
    return result


# Each part alone, then variants that tell which rule a device needs (on an H200 CUDA failed under "landlock"
# and "seccomp", and started under "seccomp-sockets-allowed"): Landlock without its abstract-socket scope, with
# its file rules only (ABI 3), with /tmp, /dev/shm and /run writable, with the write rule on the process's own
# /proc/<pid>/task (the driver names its threads there); the seccomp filter without its socket refusals or
# without its list of refused calls; every part, with and without the thread-names rule; and "worker":
# worker_side.enter_sandbox itself (the device started after Landlock, before the seccomp filter). Where
# "worker" fails, the others name the rule that is missing.
SANDBOX_PARTS = ("none", "rlimits", "noatime", "capabilities", "landlock", "landlock-no-socket-scope",
                 "landlock-files-only", "landlock-plus-tmp-shm-run", "landlock-thread-names", "seccomp",
                 "seccomp-sockets-allowed", "seccomp-no-denied-calls", "all", "all-thread-names", "worker")
SANDBOX_PROBE = r"""
import copy, os, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from harness.worker import limits, sandbox, worker_side
import torch  # before the sandbox, as the worker does
part, device = sys.argv[1], sys.argv[2]
try:
    thread_names = part in ("landlock-thread-names", "all-thread-names")
    if part == "worker":
        limits.apply_rlimits(limits.worker_rlimits(limits.worker_limits()))
        rules = sandbox.worker_rules(Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp()))
        rules += [(p, "execute") for p in sys.path if os.path.isabs(p) and os.path.isdir(p)]
        msg = {"noatime": True, "abi": sandbox.landlock_abi(), "rules": rules, "seccomp": sandbox.seccomp_arch()}
        worker_side.enter_sandbox(msg, torch.device(device))
    if part.startswith("all"):
        part = "all"
    if part in ("rlimits", "all"):
        limits.apply_rlimits(limits.worker_rlimits(limits.worker_limits()))
    if part in ("noatime", "all"):
        sandbox.remount_noatime()
    if part in ("capabilities", "all"):
        sandbox.set_no_new_privs()
        sandbox.drop_capabilities()
    if part.startswith("landlock") or part == "all":
        rules = sandbox.worker_rules(Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp()))
        rules += [(p, "execute") for p in sys.path if os.path.isabs(p) and os.path.isdir(p)]
        abi = sandbox.landlock_abi()
        if part == "landlock-no-socket-scope":
            sandbox.SCOPE_ABSTRACT_UNIX_SOCKET = 0
        if part == "landlock-files-only":
            abi = min(abi, 3)
        if part == "landlock-plus-tmp-shm-run":
            rules += [(d, "write") for d in ("/tmp", "/dev/shm", "/run", "/var/run")]
        if thread_names:
            rules.append(sandbox.thread_names_rule())
        sandbox.apply_landlock(rules, abi)
    if part.startswith("seccomp") or part == "all":
        arch = sandbox.seccomp_arch()
        if part == "seccomp-sockets-allowed":
            sandbox.SYSCALLS = copy.deepcopy(sandbox.SYSCALLS)
            sandbox.SYSCALLS[arch][1]["socket"] = 4095
            sandbox.DENIED = tuple(n for n in sandbox.DENIED if n not in ("bind", "connect", "listen"))
        if part == "seccomp-no-denied-calls":
            sandbox.DENIED = ()
        sandbox.apply_seccomp(arch)
    torch.ones(1, device=device).add_(1).item()
    print("PROBE ok")
except BaseException as e:
    print("PROBE " + type(e).__name__ + ": " + str(e).replace(chr(10), " ")[:300])
"""


def stage_sandbox(device: str) -> dict:
    """Whether a fresh process that has applied one part of the worker's sandbox (harness/worker) can still use
    the device: one process per part, all at once, and one with every part in the worker's order."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")  # as a worker's (harness_side.worker_environment)
    probes = {part: subprocess.Popen([sys.executable, "-c", SANDBOX_PROBE, part, device, str(REPO)], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for part in SANDBOX_PARTS}
    result = {}
    for part, p in probes.items():
        out = p.communicate(timeout=300)[0]
        found = [line[6:] for line in out.splitlines() if line.startswith("PROBE ")]
        result[part] = found[-1] if found else f"exit {p.returncode}: {out.strip().splitlines()[-1:]}"
    return result


def cmd_stage(args) -> int:
    name = args.name
    result = {"environment": lambda: stage_environment(args.device), "peak": lambda: stage_peak(args.device),
              "attention": lambda: stage_attention(args.device, args.rehearsal),
              "sandbox": lambda: stage_sandbox(args.device)}[name]()
    print("RESULT " + json.dumps(result))
    return 0


# -----------------------------------------------------------------------------------------------
# The driver
# -----------------------------------------------------------------------------------------------

class Check:
    def __init__(self, args):
        self.args = args
        self.rehearsal = args.rehearsal
        self.device = "cpu" if args.rehearsal else "cuda"
        self.card = card_name(args.rehearsal)  # recorded with every stage: figures compare only on one card
        self.work = Path(args.work).resolve()
        self.out = Path(args.out).resolve()
        self.deadline = time.monotonic() + args.deadline
        self.seconds = args.seconds
        self.result = json.loads(Path(args.merge).read_text()) if args.merge else {"stages": {}}
        self.stamp = Path(args.merge).stem if args.merge else time.strftime("%Y-%m-%d-%H%M%S") + \
            ("-rehearsal" if args.rehearsal else "")
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", FRONTIER_CACHE_DIR=str(self.work / "cache"))
        self.env.pop("FRONTIER_DATA_DIR", None)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    # --- subprocesses ---
    def run(self, name: str, cmd: list[str], timeout: float) -> tuple[int, str]:
        """Run cmd from the repository root, its output to <work>/logs/<name>.log; (exit status, output). A
        command past its timeout is stopped with everything it started (exit status 124)."""
        log = self.work / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"[gpu_check] {name}: {' '.join(cmd)} (timeout {timeout:.0f}s)", flush=True)
        with open(log, "w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            p = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            try:
                rc = p.wait(timeout=max(1.0, timeout))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rc = 124
        text = log.read_text(errors="replace")
        print(f"[gpu_check] {name}: exit {rc}", flush=True)
        return rc, text

    def run_contained(self, name: str, cmd: list[str]) -> list[str] | None:
        """A harness command with its sandbox; where that fails on this machine, again without it (not official).
        Returns the sandboxed attempt's error lines, or None where it succeeded."""
        rc, text = self.run(name, cmd, self.remaining())
        if rc == 0:
            return None
        rc, retry = self.run(f"{name}-nosandbox", cmd + ["--no-sandbox"], self.remaining())
        if rc != 0:
            raise StageFailed(rc, retry)
        return error_lines(text)

    def in_process(self, name: str) -> dict:
        cmd = [sys.executable, str(Path(__file__).resolve()), "stage", name, "--device", self.device]
        rc, text = self.run(name, cmd + (["--rehearsal"] if self.rehearsal else []), self.remaining())
        found = [line[7:] for line in text.splitlines() if line.startswith("RESULT ")]
        if rc != 0 or not found:
            raise StageFailed(rc, text)
        return json.loads(found[-1])

    # --- data ---
    def setup_data(self) -> None:
        """The dataset outside the repository (the worker may read the repository; the scored text must not
        be there for the evaluation to be official), made the active one of a private cache."""
        source = Path(self.args.data).resolve()
        if not (source / "manifest.json").is_file():
            raise SystemExit(f"error: {source} holds no prepared dataset (manifest.json): run "
                             "`python benchmarks/gpu_check.py prepare` first, or give --data")
        target = self.work / "data"
        if not target.is_dir():
            shutil.copytree(source, target)
        from harness.common import atomic_write_json
        (self.work / "cache").mkdir(parents=True, exist_ok=True)
        manifest = json.loads((target / "manifest.json").read_text())
        atomic_write_json(self.work / "cache" / "active.json", {"dataset_dir": str(target),
                                                                 "source": manifest["source"]})

    # --- stages ---
    def train_flags(self, name: str) -> list[str]:
        common = ["--time-budget", str(self.seconds), "--no-eval-public", "--out-dir", str(self.work / name)]
        peak = self.result["stages"].get("peak", {}).get("tflops")
        if peak:
            common += ["--peak-tflops", f"{peak:.3f}"]
        if name == "d10":  # the organisers' shape and recipe; compiled, 32 rows per micro-batch (the same batch)
            flags = ["--compile", "--device-batch-size", "32", "--log-every", "5"]
        else:
            flags = ["--preset", "gpu", "--log-every", "5"]
        return flags + common + (TINY if self.rehearsal else [])

    def train_kit(self, name: str) -> dict:
        shutil.rmtree(self.work / name, ignore_errors=True)
        cmd = [sys.executable, "train.py", *self.train_flags(name)]
        rc, text = self.run(f"{name}-train", cmd, self.remaining())
        if rc != 0:
            raise StageFailed(rc, text)
        result = {"command": "python train.py " + " ".join(self.train_flags(name)), **training_summary(text)}
        result["eval_public"] = self.eval_public(name, self.work / name / "final.pt")
        return result

    def train_nanochat(self, name: str) -> dict:
        nanochat = Path(self.args.nanochat).resolve()
        if not nanochat.is_dir():
            raise StageFailed(None, f"no nanochat runner at {nanochat} (benchmarks/gpu_check.py prepare "
                                    "--nanochat-snapshot ...)")
        out = self.work / name
        shutil.rmtree(out, ignore_errors=True)
        shape = (["--depth", "2", "--seq-len", "128", "--device-batch-size", "4", "--total-batch-size", "1024",
                  "--device", "cpu", "--no-compile", "--measure-steps", "3"] if self.rehearsal else
                 NANOCHAT_SHAPES[name] + ["--device", "cuda"])
        cmd = [sys.executable, "benchmarks/nanochat_peer.py", "train", "--work", str(nanochat), "--out", str(out),
               "--seconds", str(self.seconds), *shape, "--extra", "--window-pattern", "L"]
        rc, text = self.run(f"{name}-train", cmd, self.remaining())
        if rc != 0:
            raise StageFailed(rc, text)
        summary = json.loads((out / "summary.json").read_text())
        peak = self.result["stages"].get("peak", {}).get("tflops")
        result = {"command": " ".join(cmd[1:]), "num_params_M": summary["num_params"] / 1e6,
                  "num_steps": summary["steps"], "tokens_per_second": summary["tokens_per_second"],
                  "mfu_percent": 100 * summary["flops_per_token"] * summary["tokens_per_second"] / (peak * 1e12)
                  if peak else None, "peak_memory_mb": summary["peak_memory_mib"],
                  "startup_seconds": summary["seconds_to_step_10_logged"],  # nanochat times from step 11 on
                  "first_step_seconds": summary["first_step_dt_s"], "training_seconds": summary["training_seconds"],
                  "nanochat": {k: v for k, v in summary.items() if k not in ("command", "env")}}
        result["eval_public"] = self.eval_public(name, out / "final.pt")
        return result

    def eval_public(self, name: str, checkpoint: Path) -> dict:
        """prepare.py eval-public through the contained worker; where the sandbox cannot be applied on this
        machine, the same without it (not official), with the first attempt's error kept."""
        report = self.work / name / "eval_public.json"
        cmd = [sys.executable, "prepare.py", "eval-public", "--train-py", TRAINED[name], "--checkpoint",
               str(checkpoint), "--report", str(report)]
        # the device named: a worker that cannot reach it fails, where "auto" would score on the CPU
        cmd += ["--max-tokens", "8192", "--device", "cpu"] if self.rehearsal else ["--device", "cuda"]
        first_error = self.run_contained(f"{name}-eval", cmd)
        r = json.loads(report.read_text())
        keep = ("val_bpb", "official", "not_official_because", "tokens", "total_bytes", "eval_seconds",
                "causality_passed", "causality_max_abs_diff", "batch_size_max_abs_diff", "replay_max_abs_diff",
                "probes", "probe_coverage", "device", "sandbox", "worker_start_seconds")
        found = {k: r[k] for k in keep if k in r}
        if first_error:
            found["sandboxed_attempt_failed"] = first_error
        return found

    def d10_checkpoint(self) -> Path:
        checkpoint = self.work / "d10" / "final.pt"
        if not checkpoint.is_file():
            raise StageFailed(None, f"no d10 checkpoint at {checkpoint} (the d10 stage did not finish)")
        return checkpoint

    def core(self) -> dict:
        checkpoint = self.d10_checkpoint()
        examples = 12 if self.rehearsal else BUNDLE_EXAMPLES
        bundle = write_text_bundle(self.work / "data", self.work / "bundle", examples)
        report = self.work / "d10" / "core.json"
        cmd = [sys.executable, "prepare.py", "eval-core", "--inference-py", "inference.py", "--train-py", "train.py",
               "--checkpoint", str(checkpoint), "--bundle-dir", str(bundle), "--report", str(report)]
        if self.rehearsal:  # one task of each kind
            cmd += ["--device", "cpu", "--tasks", "hellaswag_zeroshot,jeopardy,winograd"]
        else:
            cmd += ["--device", "cuda"]
        first_error = self.run_contained("core", cmd)
        r = json.loads(report.read_text())
        from harness.checks import TOLERANCE_NATS
        from harness.core import verify
        result = {"core": r["core"], "examples": r["examples"], "seconds": r["seconds"], "official": r["official"],
                  "not_official_because": r["not_official_because"], "device": r.get("device"),
                  "bundle": f"{examples} examples of each of CORE's 22 task shapes made from the public_val "
                            "text (not CORE's tasks: a check of the path, not a score to compare)",
                  "honest_differences": {k: r["verify"][k] for k in
                                         ("examples", "max_abs_loss_diff", "max_token_loss_diff", "max_causal_diff",
                                          "max_greedy_gap", "decisions_flipped_within_allowance", "max_flipped_margin",
                                          "bias", "coverage")
                                         if k in (r.get("verify") or {})},
                  "tolerances": {"loss": verify.VERIFY_LOSS_TOLERANCE, "token": verify.VERIFY_TOKEN_TOLERANCE,
                                 "greedy": verify.VERIFY_GREEDY_TOLERANCE,
                                 "decision": dict(verify.DECISION_ALLOWANCE_NATS),
                                 "val_bpb_checks": TOLERANCE_NATS}}
        if first_error:
            result["sandboxed_attempt_failed"] = first_error
        return result

    def tolerances(self) -> dict:
        """The honest bf16 differences of d10 on this device: the val_bpb checks at an official run's probe
        count (3,414 a run), and CORE's (check_tolerances.py)."""
        checkpoint = self.d10_checkpoint()
        small = ["--secrets", "1", "--examples", "1", "--bias-runs", "20", "--max-tokens", "2048"]
        cmd = [sys.executable, "benchmarks/check_tolerances.py", "--checkpoint", str(checkpoint), "--dtypes", "bf16",
               "--device", self.device, "--probes", "16" if self.rehearsal else "3414",
               *(small if self.rehearsal else ["--secrets", "3", "--examples", "4", "--max-tokens", "262144"])]
        rc, text = self.run("tolerances", cmd, self.remaining())
        if rc != 0:
            raise StageFailed(rc, text)
        lines = text.splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("--- bf16")), 1)
        return {"command": " ".join(cmd[1:]), "lines": lines[start:start + 8]}

    def stage(self, name: str) -> dict:
        if name in ("environment", "peak", "attention", "sandbox"):
            return self.in_process(name)
        if name in ("d10", "gpu"):
            return self.train_kit(name)
        if name in NANOCHAT_SHAPES:
            return self.train_nanochat(name)
        return {"core": self.core, "tolerances": self.tolerances}[name]()

    def needs(self, name: str) -> float:
        return OVERHEAD_SECONDS[name] + (self.seconds if name in TRAINED else 0)

    def main(self) -> int:
        self.setup_data()
        only = self.args.only.split(",") if self.args.only else list(STAGES)
        unknown = sorted(set(only) - set(STAGES))
        if unknown:
            raise SystemExit(f"error: --only: unknown stages {unknown}; the stages are {', '.join(STAGES)}")
        if self.args.skip:
            only = [s for s in only if s not in self.args.skip.split(",")]
        self.result.update(started=time.strftime("%Y-%m-%d %H:%M:%S"), rehearsal=self.rehearsal,
                           seconds_per_run=self.seconds, commit=git_commit())
        for name in [s for s in STAGES if s in only]:
            t0 = time.monotonic()
            if self.remaining() < self.needs(name):
                entry = {"status": "skipped", "why": f"{self.remaining():.0f}s left of --deadline, the stage needs "
                                                     f"about {self.needs(name):.0f}s"}
            else:
                try:
                    entry = {"status": "ok", **self.stage(name)}
                except StageFailed as e:
                    entry = {"status": "failed", "exit": e.rc, "error": error_lines(e.text)}
            entry["wall_seconds"] = round(time.monotonic() - t0, 1)
            entry["card"] = self.card
            self.result["stages"][name] = entry
            print(f"[gpu_check] {name}: {entry['status']} in {entry['wall_seconds']}s", flush=True)
            self.write()
        failed = [n for n, e in self.result["stages"].items() if e["status"] != "ok"]
        print(f"[gpu_check] wrote {self.out / self.stamp}.json and .md" +
              (f"; not ok: {', '.join(failed)}" if failed else ""), flush=True)
        return 0

    def write(self) -> None:
        from harness.common import atomic_write_json
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.out / f"{self.stamp}.json", self.result)
        tmp = self.out / f"{self.stamp}.md.tmp"
        tmp.write_text(markdown(self.result))
        tmp.replace(self.out / f"{self.stamp}.md")


class StageFailed(Exception):
    def __init__(self, rc, text: str):
        super().__init__(text)
        self.rc, self.text = rc, text


def error_lines(text: str, n: int = 12) -> list[str]:
    """The last lines of a failed command's output, where its error is."""
    return [line[:400] for line in text.strip().splitlines()[-n:]]


def card_name(rehearsal: bool) -> str:
    """The card this invocation measures on, as nvidia-smi names it (the driver process never opens the GPU)."""
    if rehearsal:
        return "CPU (rehearsal)"
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        names = []
    return names[0] if names else "unknown GPU"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


STEP_LINE = re.compile(r"^step (\d+) \(\s*([\d.]+)%\) \| loss: ([\d.]+) \| lrm: [\d.]+ \| dt: (\d+)ms \| "
                       r"tok/sec: ([\d,]+) \| mfu: ([\d.]+)%")
SUMMARY_KEYS = {"num_steps": int, "tokens_per_second": float, "mfu_percent": float, "peak_memory_mb": float,
                "startup_seconds": float, "training_seconds": float, "charged_seconds": float,
                "total_seconds": float, "num_params_M": float, "train_loss": float, "peak_tflops": float,
                "total_tokens_M": float, "median_step_seconds": float, "over_budget": str, "compute_dtype": str,
                "device": str}


def training_summary(text: str) -> dict:
    """train.py's summary after `---` (the keys of SUMMARY_KEYS), its first step's seconds (the cold compile)
    and the loss curve from its progress lines: [step, % of the budget, smoothed loss, tokens/s]."""
    lines = text.splitlines()
    if "---" not in lines:
        raise StageFailed(None, text)
    summary = {}
    for line in lines[len(lines) - 1 - lines[::-1].index("---") + 1:]:
        key, _, value = line.partition(":")
        if key.strip() in SUMMARY_KEYS:
            summary[key.strip()] = SUMMARY_KEYS[key.strip()](value.strip())
    curve = [[int(m[1]), float(m[2]), float(m[3]), int(m[5].replace(",", ""))]
             for m in map(STEP_LINE.match, lines) if m]
    first = next((int(m[4]) / 1000 for m in map(STEP_LINE.match, lines) if m), None)
    return {**summary, "first_step_seconds": first, "loss_curve": curve}


# -----------------------------------------------------------------------------------------------
# A small bundle in CORE's format and task shapes, made from the public_val text
# -----------------------------------------------------------------------------------------------

def write_text_bundle(dataset_dir: Path, root: Path, examples: int | float, seed: int = 0) -> Path:
    """An eval bundle (core.yaml, eval_meta_data.csv, eval_data/*.jsonl) with CORE's 22 task labels and shapes
    (benchmarks/check_tolerances.py: type, shots, delimiter, lengths, choices), `examples` a task (a float: that
    share of the real task's examples, at least its shots and 8 more), each example cut from the
    public_val text: a multiple-choice query is a passage, its gold choice the words that follow it and the
    others words from elsewhere; a schema example's options are that passage and others, followed by its
    continuation; a language-modelling example asks for the words that follow. A model that learned the
    text beats chance on them, so the figure moves with training; it is not CORE."""
    import pyarrow.parquet as pq
    from check_tolerances import CORE_TASKS
    from harness.data import split_shards
    words = []
    for shard in split_shards("public_val", dataset_dir):
        for text in pq.read_table(shard, columns=["text"]).column("text").to_pylist():
            words.append(text.split())
    words = [w for w in words if len(w) >= 64]
    rng = random.Random(seed)

    def passage(n: int, then: int) -> tuple[str, str]:
        doc = rng.choice(words)
        n = min(n, len(doc) - then - 1)
        start = rng.randrange(0, len(doc) - n - then)
        return " ".join(doc[start:start + n]), " ".join(doc[start + n:start + n + then])

    bundle = root / "eval_bundle"
    shutil.rmtree(root, ignore_errors=True)
    (bundle / "eval_data" / "text").mkdir(parents=True)
    yaml, meta = ["icl_tasks:"], []
    for label, kind, shots, delimiter, real, context_words, choices, choice_words in CORE_TASKS:
        rows, count = [], examples if isinstance(examples, int) else max(shots + 8, round(examples * real))
        for _ in range(count):
            context, follows = passage(context_words, choice_words)
            if kind == "multiple_choice":
                options = [follows] + [passage(choice_words, 0)[0] for _ in range(choices - 1)]
                gold = rng.randrange(choices)
                options[0], options[gold] = options[gold], options[0]
                rows.append({"query": context, "choices": options, "gold": gold})
            elif kind == "schema":
                options = [context] + [passage(context_words, 0)[0] for _ in range(choices - 1)]
                gold = rng.randrange(choices)
                options[0], options[gold] = options[gold], options[0]
                rows.append({"context_options": options, "continuation": follows, "gold": gold})
            else:
                rows.append({"context": context, "continuation": follows})
        with open(bundle / "eval_data" / "text" / f"{label}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        yaml += [f"- label: {label}", f"  dataset_uri: text/{label}.jsonl", f"  num_fewshot: [{shots}]",
                 f"  icl_task_type: {kind}", f"  continuation_delimiter: {json.dumps(delimiter)}"]
        chance = 0.0 if kind == "language_modeling" else 100.0 / choices
        meta.append([label, "text", kind, shots, count, chance, "Yes", "public_val text in a CORE task's shape"])
    (bundle / "core.yaml").write_text("\n".join(yaml) + "\n")
    with open(bundle / "eval_meta_data.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["Eval Task", "Task Category", "Task Type", "#shots", "#datapoints", "Random baseline",
                    "Centered Metric?", "Description"])
        w.writerows(meta)
    return bundle


# -----------------------------------------------------------------------------------------------
# The table
# -----------------------------------------------------------------------------------------------

def fmt(value, spec: str = "") -> str:
    return "–" if value is None else format(value, spec)


def official_why(evaluation: dict) -> str:
    reasons = evaluation.get("not_official_because") or []
    return f" ({'; '.join(reasons)})" if reasons else ""


def markdown(result: dict) -> str:
    s = result["stages"]
    env = s.get("environment", {})
    lines = [f"# gpu_check {result.get('started', '')} (commit {result.get('commit')})", "",
             f"{env.get('gpu', env.get('status', '–'))}, driver {env.get('driver', '–')}, "
             f"torch {env.get('torch', '–')}, "
             f"CUDA {env.get('cuda', '–')}; bf16 matmul peak measured {fmt(s.get('peak', {}).get('tflops'), '.0f')} "
             f"TFLOP/s (MFU's denominator). Each run trained for {result.get('seconds_per_run')} s of charged time.",
             "", "| run | card | params (M) | steps | tokens/s | MFU % | peak memory (GiB) | start-up s | "
             "first step s | val_bpb | official |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, title in (("d10", "kit d10 (organisers' shape), compiled"),
                        ("nanochat", "nanochat 92d63d4 at d10 (full context)"), ("gpu", "kit --preset gpu"),
                        ("nanochat_gpu", "nanochat 92d63d4 at the preset's d8 (full context)")):
        r = s.get(name)
        if not r:
            continue
        if r["status"] != "ok":
            lines.append(f"| {title} | {r.get('card', '–')} | {r['status']}: "
                         f"{' '.join(r.get('error', [r.get('why', '')])[-1:])[:120]} | | | | | | | | |")
            continue
        e = r.get("eval_public", {})
        memory = r.get("peak_memory_mb")
        lines.append(f"| {title} | {r.get('card', '–')} | {fmt(r.get('num_params_M'), '.1f')} | {fmt(r.get('num_steps'))} | "
                     f"{fmt(r.get('tokens_per_second'), ',.0f')} | {fmt(r.get('mfu_percent'), '.1f')} | "
                     f"{fmt(memory / 1024 if memory else None, '.1f')} | {fmt(r.get('startup_seconds'), '.1f')} | "
                     f"{fmt(r.get('first_step_seconds'), '.1f')} | {fmt(e.get('val_bpb'), '.4f')} | "
                     f"{e.get('official')}{official_why(e)} |")
    core = s.get("core", {})
    if core.get("status") == "ok":
        h = core["honest_differences"]
        lines += ["", f"CORE-shaped bundle from public_val (d10, {core.get('card')}): {core['core']:.4f} over "
                      f"{core['examples']} examples in "
                      f"{core['seconds']:.0f} s; official {core['official']}. Honest bf16 differences, inference.py "
                      f"against the trusted path: mean loss {fmt(h.get('max_abs_loss_diff'), '.3g')} nats (tolerance "
                      f"{core['tolerances']['loss']}), twins {fmt(h.get('max_causal_diff'), '.3g')}, decisions flipped "
                      f"within the allowance {h.get('decisions_flipped_within_allowance')}."]
    att = s.get("attention", {})
    if att.get("status") == "ok":
        lines += ["", f"Window attention ({att['shape']}, {att['pass']}): dense mask {att['sdpa_dense_mask_ms']} ms, "
                      f"FlexAttention {att['flex_block_mask_ms']} ms ({att['dense_over_flex']}x), full causal flash "
                      f"{att['sdpa_causal_full_ms']} ms; max difference {att['flex_vs_dense_max_abs_diff']:.3g}."]
    sandbox = s.get("sandbox", {})
    if sandbox.get("status") == "ok":
        parts = {k: v for k, v in sandbox.items() if k not in ("status", "wall_seconds", "card")}
        lines += ["", f"Sandbox parts on {sandbox.get('card')} (a fresh process applies each, then uses the device): "
                      + "; ".join(f"{k}: {v}" for k, v in parts.items())]
    tol = s.get("tolerances", {})
    if tol.get("status") == "ok":
        lines += ["", f"Honest differences on {tol.get('card')} (`{tol['command']}`):", ""]
        lines += [f"    {line}" for line in tol["lines"]]
    lines += ["", "| stage | card | status | wall s |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {e.get('card', '–')} | {e['status']} | {e.get('wall_seconds')} |" for name, e in s.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="build the data (and nanochat's runner) the GPU machine needs, here")
    p.add_argument("--nanochat-snapshot", default=None, help="nanochat's pinned tarball (nanochat-92d63d4.tar.gz)")
    p.set_defaults(func=cmd_prepare)
    p = sub.add_parser("run", help="run the stages and write <out>/<stamp>.json and .md")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu"))
    p.add_argument("--work", default="/tmp/gpu_check", help="scratch folder, outside the repository")
    p.add_argument("--data", default=str(GPU_DIR / "data"), help="the dataset `prepare` built")
    p.add_argument("--nanochat", default=str(GPU_DIR / "nanochat"), help="nanochat's runner folder `prepare` built")
    p.add_argument("--seconds", type=float, default=40.0, help="charged training seconds of each run")
    p.add_argument("--deadline", type=float, default=540.0, help="seconds for all stages; one that no longer fits "
                                                                 "is skipped")
    p.add_argument("--only", default=None, help=f"comma-separated stages (of {', '.join(STAGES)})")
    p.add_argument("--skip", default=None, help="comma-separated stages to leave out")
    p.add_argument("--merge", default=None, help="an earlier result JSON: add these stages' results to it")
    p.add_argument("--rehearsal", action="store_true", help="every stage at tiny sizes on the CPU")
    p.set_defaults(func=lambda a: Check(a).main())
    p = sub.add_parser("stage", help=argparse.SUPPRESS)
    p.add_argument("name", choices=("environment", "peak", "attention", "sandbox"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--rehearsal", action="store_true")
    p.set_defaults(func=cmd_stage)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
