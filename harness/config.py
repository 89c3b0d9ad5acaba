"""The competition's constants (train.py imports them through prepare.py) and the environment
variables the harness reads: the kit's FRONTIER_* names and, where they mean the same thing, the
names of the organisers' kit (NEURON_COMPETITION_R1_*)."""
from __future__ import annotations

import os
from pathlib import Path

from harness.common import ConfigError

TOKENIZER_VOCAB_SIZE = 8192
PHASE_BUDGET_SECONDS = {1: 1800, 2: 14400}  # Phase 1: 30 min on one chip; Phase 2: 4 h on 16 chips


def _phase_from_env() -> int:
    raw = os.environ.get("FRONTIER_PHASE", "1").strip()
    if raw not in ("1", "2"):
        raise SystemExit(f"error: FRONTIER_PHASE must be 1 or 2, got {raw!r}")
    return int(raw)


COMPETITION_PHASE = _phase_from_env()
TRAIN_TIME_BUDGET_SECONDS = PHASE_BUDGET_SECONDS[COMPETITION_PHASE]
TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS = 900  # imports, compilation, first steps: not charged, up to this
TRAIN_STARTUP_STEPS_EXCLUDED = 5  # the first five optimizer steps (compilation, warm-up) count as start-up
EVAL_TIMEOUT_SECONDS = 1200  # the scorer's limit for evaluate_bpb
EVAL_SEQ_LEN = 1024  # the scorer's evaluation context, whatever the model trained with
EVAL_TOKENS = 20 * 2**20  # scored tokens per official evaluation (fewer if the shard holds fewer)
EVAL_BATCH_SIZE = 8  # rows per forward in the CLI; the result does not depend on it
TRAIN_EVAL_TOKENS = 4 * 524_288  # train.py's own end-of-run evaluation, as in the organisers' kit

# The tokenizer: BPE, GPT-4 split pattern with \p{N}{1,2} (nanochat's choice for small vocabularies).
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)
SPECIAL_TOKENS = (
    "<|bos|>",  # every document starts with it; rows of the dataloader start with it
    "<|user_start|>", "<|user_end|>",
    "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>",
    "<|output_start|>", "<|output_end|>",
)
BOS_TOKEN = "<|bos|>"

# ClimbMix: the public shards; the last one is the public validation split.
CLIMBMIX_BASE_URL = "https://huggingface.co/datasets/karpathy/climbmix-400b-shuffle/resolve/main"
CLIMBMIX_LAST_SHARD = 6542  # shard_06542.parquet: pinned as the public validation split

REPO_DIR = Path(__file__).resolve().parents[1]
SHIPPED_TOKENIZER_DIR = REPO_DIR / "tokenizer"
SHIPPED_TOKENIZER_PINS = SHIPPED_TOKENIZER_DIR / "SHA256SUMS"

# ---------------------------------------------------------------------------------------------
# Environment variables
# ---------------------------------------------------------------------------------------------
# setting -> (the kit's name, the organisers' kit's name). Either may be set; if both are set they
# must agree. Settings the kit reads only under its own name (FRONTIER_DATA_DIR, FRONTIER_PHASE,
# FRONTIER_CLIMBMIX_BASE_URL, FRONTIER_EVAL_BUNDLE_URL/_SHA256) are read where they are used.
ENV_NAMES = {
    "cache_dir": ("FRONTIER_CACHE_DIR", "NEURON_COMPETITION_R1_CACHE_DIR"),  # data + tokenizer cache
    "tokenizer_path": ("FRONTIER_TOKENIZER_PATH", "NEURON_COMPETITION_R1_TOKENIZER_PATH"),
    "tokenizer_sha256": ("FRONTIER_TOKENIZER_SHA256", "NEURON_COMPETITION_R1_TOKENIZER_SHA256"),
    "out_dir": ("FRONTIER_OUT_DIR", "NEURON_COMPETITION_R1_OUT_DIR"),  # where train.py writes final.pt
    "eval_public": ("FRONTIER_EVAL_PUBLIC", "NEURON_COMPETITION_R1_EVAL_PUBLIC"),  # train.py's end-of-run eval
    "eval_tokens": ("FRONTIER_EVAL_TOKENS", "NEURON_COMPETITION_R1_EVAL_TOKENS"),  # ... and its token count
    # the kit's own: keep the kernel's caches between an evaluation's workers (a development machine
    # that must not have them dropped at every evaluation; the result is then not official)
    "keep_kernel_caches": ("FRONTIER_KEEP_KERNEL_CACHES", None),
}
# Names of the organisers' kit that have no counterpart here, and why.
IGNORED_ENV = {
    "NEURON_COMPETITION_R1_TOKENIZER_URL": "the kit never downloads a tokenizer: it ships or builds a plain JSON one",
    "NEURON_COMPETITION_R1_TOKENIZER_PKL_SHA256": "the kit never loads pickles; pin a JSON tokenizer with "
                                                  "NEURON_COMPETITION_R1_TOKENIZER_SHA256",
    "NEURON_COMPETITION_R1_TOKEN_BYTES_SHA256": "token byte lengths are computed from the pinned tokenizer itself",
}


def env_setting(key: str) -> tuple[str | None, str | None]:
    """(value, the variable it came from), or (None, None) when neither name is set."""
    ours, theirs = ENV_NAMES[key]
    a, b = os.environ.get(ours) or None, (os.environ.get(theirs) or None) if theirs else None
    if a is not None and b is not None and a != b:
        raise ConfigError(f"{ours}={a!r} and {theirs}={b!r} disagree; they mean the same thing: unset one")
    return (a, ours) if a is not None else (b, theirs) if b is not None else (None, None)


def env_report() -> list[str]:
    """One line per setting taken from the environment, naming the variable, plus the organisers'
    variables that are set but have no meaning here."""
    lines = []
    for key in ENV_NAMES:
        value, name = env_setting(key)
        if value is not None:
            lines.append(f"[env] {key} = {value} (from {name})")
    for name, why in IGNORED_ENV.items():
        if os.environ.get(name):
            lines.append(f"[env] {name} is set and ignored: {why}")
    return lines


def _parse_bool(value: str, name: str) -> bool:
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={value!r}: expected 1/0, true/false, yes/no or on/off")


def cache_root() -> Path:
    value, _ = env_setting("cache_dir")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "trainium-frontier"


def default_out_dir() -> str:
    """Where train.py writes final.pt unless told otherwise."""
    return env_setting("out_dir")[0] or "out"


def default_train_eval_public() -> bool:
    """Whether train.py runs its end-of-run evaluation on public_val unless told otherwise."""
    value, name = env_setting("eval_public")
    return True if value is None else _parse_bool(value, name)


def keep_kernel_caches() -> bool:
    """Whether an evaluation keeps the kernel's caches between its workers (default: it drops them)."""
    value, name = env_setting("keep_kernel_caches")
    return False if value is None else _parse_bool(value, name)


def default_train_eval_tokens() -> int:
    """Tokens of train.py's end-of-run evaluation unless told otherwise."""
    value, name = env_setting("eval_tokens")
    if value is None:
        return TRAIN_EVAL_TOKENS
    try:
        tokens = int(value)
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise ConfigError(f"{name}={value!r}: expected a number of tokens >= 0")
    return tokens
