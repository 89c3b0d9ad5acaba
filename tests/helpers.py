"""Shared test helpers: tiny generated data, the shipped tokenizer, toy models."""
from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import prepare  # noqa: E402

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu the of and to in is was for on "
         "with as by at from que été naïve café 北京 東京 Ωmega").split()


def flags_for(settings: dict) -> list[str]:
    """train.py's command-line flags that make these settings ({field: value}, as in its PRESETS)."""
    flags = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
    return flags


def every_ingredient() -> dict:
    """{field: a value that turns it on} for every ingredient of train.py's Architecture (an `ingredient(off, on)`)."""
    import dataclasses
    sys.path.insert(0, str(REPO))
    import train
    return {f.name: f.metadata["on"] for f in dataclasses.fields(train.Architecture) if "on" in f.metadata}


def shipped_tokenizer() -> prepare.Tokenizer:
    path = prepare.SHIPPED_TOKENIZER_DIR / "stdlib.json"
    return prepare.Tokenizer.from_file(path, prepare.sha256_file(path))


def random_documents(n: int, seed: int = 0, min_words: int = 20, max_words: int = 150) -> list[str]:
    """n distinct documents (each carries its index, so no two are equal)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
        docs.append(f"Document {i}. " + " ".join(words) + ".")
    return docs


def documents_with_token_count(tokenizer, n_tokens: int, k: int, seed: int = 0) -> list[str]:
    """k distinct documents that each encode to exactly n_tokens tokens (BOS not counted)."""
    rng = random.Random(seed)
    docs, seen = [], set()
    while len(docs) < k:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, n_tokens)))
        if text not in seen and len(tokenizer.encode(text)) == n_tokens:
            seen.add(text)
            docs.append(text)
    return docs


def write_shard(path: Path, docs: list[str], row_group_size: int = 64) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": pa.array(docs, type=pa.string())}), path, row_group_size=row_group_size)
    return path


def make_text_source(folder: Path, docs: list[str], per_file: int = 50) -> Path:
    """A dir: source of .jsonl files holding the documents."""
    import json
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(0, len(docs), per_file):
        with open(folder / f"part_{k // per_file:03d}.jsonl", "w", encoding="utf-8") as f:
            for doc in docs[k:k + per_file]:
                f.write(json.dumps({"text": doc}) + "\n")
    return folder


def run_prepare(args: list[str], env_extra: dict | None = None, cwd: Path = REPO, timeout: int = 600):
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "prepare.py", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def can_drop_kernel_caches() -> bool:
    """Whether this machine lets the harness drop the kernel's caches between workers (root)."""
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


def _child_subreaper(value: int | None = None) -> int:
    """This process's child-subreaper flag (prctl), set to value when given; the flag before."""
    import ctypes
    libc, flag = ctypes.CDLL(None, use_errno=True), ctypes.c_int(0)
    libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
    if value is not None:
        libc.prctl(PR_SET_CHILD_SUBREAPER, value, 0, 0, 0)
    return flag.value


def prepare_in_process(args: list[str], env_extra: dict | None = None, timeout: int = 600
                       ) -> subprocess.CompletedProcess:
    """`python prepare.py ARGS` run in this process, its exit code and output as run_prepare returns them:
    for what is not about the harness's own process (the commands' checks and messages, what a worker may
    do: workers are real sandboxed processes either way). The scorer's process hygiene (undumpable,
    SIGTERM, what a worker can see of its parent) stays the real process's, tested through run_prepare.
    The environment, the temporary folder, SIGTERM's handler and the child-subreaper flag (the harness
    adopts its workers' orphans) are put back afterwards; past timeout seconds the test process prints
    every thread's stack and exits, as run_prepare's timeout would stop a hung command."""
    import contextlib
    import faulthandler
    import io
    import signal
    import tempfile
    from unittest import mock
    from harness import cli
    saved_env, saved_tempdir, sigterm = dict(os.environ), tempfile.tempdir, signal.getsignal(signal.SIGTERM)
    subreaper = _child_subreaper()
    out, err = io.StringIO(), io.StringIO()
    os.environ.update(env_extra or {})
    tempfile.tempdir = None  # TMPDIR as this call's environment has it
    faulthandler.dump_traceback_later(timeout, exit=True, file=sys.__stderr__)  # a real file: sys.stderr may be a capture
    try:
        with mock.patch.object(cli, "make_undumpable", lambda: None), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            code = cli.main(list(args))
    finally:
        faulthandler.cancel_dump_traceback_later()
        os.environ.clear()
        os.environ.update(saved_env)
        tempfile.tempdir = saved_tempdir
        signal.signal(signal.SIGTERM, sigterm)
        _child_subreaper(subreaper)
    return subprocess.CompletedProcess(["prepare.py", *args], code, out.getvalue(), err.getvalue())


def setup_in_process(args: list[str], env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """`python prepare.py setup ARGS` in this process (prepare_in_process)."""
    return prepare_in_process(["setup", *args], env_extra)


# --- toy models for the metric ------------------------------------------------------------------

def bf16_matmuls_are_slow() -> bool:
    """True on a CPU without oneDNN's fast bf16 (no AVX-512 BF16): there PyTorch's bf16 GEMM is a
    reference loop, ~7x slower than fp32 at the tiny model's vocabulary projection."""
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


@contextlib.contextmanager
def bf16_linears_on_the_fp32_gemm():
    """Inside: every linear that runs in bf16 (bf16 operands, or under CPU autocast to bf16) computes
    what the bf16 GEMM computes (bf16 operands, exact products summed in fp32, one rounding to bf16),
    with the fp32 GEMM: a different summation order, so a few outputs in 10^4 land one bf16 step
    apart (tests/test_checks.py measures it). Activations, attention and the logits stay bf16. Used
    by in-process checks on hosts where bf16_matmuls_are_slow(); command runs keep the real kernel."""
    import torch.nn.functional as F
    linear = F.linear

    def as_fp32_gemm(x, weight, bias=None):
        in_bf16 = (x.dtype == weight.dtype == torch.bfloat16) or (torch.is_autocast_enabled("cpu")
                                                                  and torch.get_autocast_dtype("cpu") == torch.bfloat16)
        if not in_bf16:
            return linear(x, weight, bias)
        with torch.autocast("cpu", enabled=False):
            y = linear(x.bfloat16().float(), weight.bfloat16().float(), None if bias is None else bias.bfloat16().float())
        return y.bfloat16()

    F.linear = as_fp32_gemm
    try:
        yield
    finally:
        F.linear = linear


class UniformModel(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, idx):
        return torch.zeros(*idx.shape, self.vocab)


class BigramModel(nn.Module):
    """logits[t] = log_probs[idx[t]]: a pure function of the current token."""

    def __init__(self, log_probs: torch.Tensor):
        super().__init__()
        self.register_buffer("log_probs", log_probs.float())

    def forward(self, idx):
        return self.log_probs[idx]


class PeekModel(nn.Module):
    """Cheats: puts its mass on the *next* input token, which it should not see."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, self.vocab)
        nxt = torch.roll(idx, -1, dims=1)
        logits.scatter_(2, nxt.unsqueeze(-1), 10.0)
        return logits


class PeekExceptAtFixedCuts(PeekModel):
    """Peeks at every position except three fixed cut points (1, T/2, T-1), where a check with fixed cuts looks."""

    def __init__(self, vocab: int, seq_len: int):
        super().__init__(vocab)
        self.honest = [1, seq_len // 2, seq_len - 1]

    def forward(self, idx):
        logits = super().forward(idx)
        for c in self.honest:
            logits[:, c - 1] = 0.0
        return logits


class PeekAfterWarmup(PeekModel):
    """Honest (uniform) in its first forwards, where a check of the first forwards only looks; peeks afterwards."""

    def __init__(self, vocab: int, warmup: int):
        super().__init__(vocab)
        self.calls, self.warmup = 0, warmup

    def forward(self, idx):
        self.calls += 1
        return super().forward(idx) if self.calls > self.warmup else torch.zeros(*idx.shape, self.vocab)


class PeekOnRealText(PeekModel):
    """Peeks only on rows that repeat a token, as real text does and random token rows almost never do."""

    def forward(self, idx):
        logits = super().forward(idx)
        for b in range(idx.shape[0]):
            if len(set(idx[b].tolist())) > 0.9 * idx.shape[1]:
                logits[b] = 0.0
        return logits


class PeekWithHugeSpecialLogit(PeekModel):
    """Peeks, and puts -1e7 on a special token that is never scored (max |logits| would be 1e7)."""

    def forward(self, idx):
        logits = super().forward(idx)
        logits[..., self.vocab - 1] = -1e7
        return logits


class LogitsSubclass(torch.Tensor):
    """A tensor that would intercept the functions a harness calls on it."""


class SubclassModel(UniformModel):
    def forward(self, idx):
        return super().forward(idx).as_subclass(LogitsSubclass)


class NoisyModel(UniformModel):
    """Different log-probs every call: not a pure function."""

    def forward(self, idx):
        return torch.rand(*idx.shape, self.vocab)


class BatchMixModel(nn.Module):
    """Row outputs depend on the other rows of the batch: each row's distribution is sharpened by a
    statistic of its neighbour row."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, idx):
        preference = torch.linspace(0.0, 5.0, self.vocab)
        scale = torch.roll(idx, 1, dims=0).float().mean(dim=1) / 4096  # [B]
        return (scale[:, None, None] * preference).expand(*idx.shape, self.vocab).clone()


class BatchSizeModel(nn.Module):
    """Outputs depend on how many rows are in the batch."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, self.vocab)
        logits[..., 0::2] = float(idx.shape[0])
        return logits


class NaNModel(UniformModel):
    def forward(self, idx):
        out = super().forward(idx)
        out[0, -1, 0] = float("nan")
        return out


class WrongShapeModel(UniformModel):
    def forward(self, idx):
        return torch.zeros(idx.shape[0], self.vocab)  # forgot the time dimension


def git(repo, *args) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def commit_new_repo(repo: Path, branch: str, message: str) -> Path:
    """git init repo on branch, and commit everything in it as one commit."""
    git(repo, "init", "-q", "-b", branch)
    git(repo, "config", "user.email", "test@example.com")
    git(repo, "config", "user.name", "test")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", message)
    return repo
