"""
The trusted harness of the trainium-frontier kit, as participants see it: the names train.py
imports (constants, tokenizer, dataloader, budget ledger, evaluate_bpb, causality_check) and the
command line. Participants do not edit it; the implementation lives in harness/.

    python prepare.py setup                         # ClimbMix shards + tokenizer
    python prepare.py setup --source stdlib         # offline: shards from Python's standard library
    python prepare.py eval-public --train-py train.py --checkpoint out/final.pt
    python prepare.py eval --val-shard PATH --train-py train.py --checkpoint out/final.pt
    python prepare.py eval-core --inference-py inference.py --checkpoint out/final.pt   # Phase 2

The command line runs participant code only in separate worker processes (harness/worker/);
see docs/trust-model.md.
"""
from __future__ import annotations

import sys

from harness.common import (BadShardError, BudgetError, ConfigError, DataError, DownloadError, EvalRefused,
                            HarnessError, TokenizerError, atomic_write_bytes, atomic_write_json, detect_device_type,
                            get_dist_info, print0, sha256_file)
from harness.config import (BOS_TOKEN, CLIMBMIX_BASE_URL, CLIMBMIX_LAST_SHARD, COMPETITION_PHASE, EVAL_BATCH_SIZE,
                            EVAL_SEQ_LEN, EVAL_TIMEOUT_SECONDS, EVAL_TOKENS, PHASE_BUDGET_SECONDS,
                            SHIPPED_TOKENIZER_DIR, SPECIAL_TOKENS, SPLIT_PATTERN, TOKENIZER_VOCAB_SIZE,
                            TRAIN_EVAL_TOKENS, TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS, TRAIN_STARTUP_STEPS_EXCLUDED,
                            TRAIN_TIME_BUDGET_SECONDS, cache_root)
from harness.data import active_dataset_dir, check_shard, load_manifest, split_shards
from harness.ledger import (budget_status, charged_seconds, median_step_seconds, record_step_boundary,
                            resume_ledger)
from harness.loader import _document_batches, _row_group_texts, _row_groups_for_split, make_dataloader
from harness.metric import causality_check, evaluate_bpb
from harness.tokenizer import Tokenizer, ensure_tokenizer, get_token_bytes

__all__ = [
    # the organisers' kit: the names train.py files written for it import
    "TOKENIZER_VOCAB_SIZE", "TRAIN_TIME_BUDGET_SECONDS", "TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS",
    "TRAIN_STARTUP_STEPS_EXCLUDED", "EVAL_TIMEOUT_SECONDS", "get_dist_info", "print0", "Tokenizer",
    "ensure_tokenizer", "get_token_bytes", "make_dataloader", "_row_groups_for_split", "_document_batches",
    "record_step_boundary", "evaluate_bpb", "causality_check",
    # the kit's own additions
    "EVAL_SEQ_LEN", "EVAL_TOKENS", "EVAL_BATCH_SIZE", "TRAIN_EVAL_TOKENS", "COMPETITION_PHASE", "PHASE_BUDGET_SECONDS",
    "SPECIAL_TOKENS", "BOS_TOKEN", "SPLIT_PATTERN", "CLIMBMIX_BASE_URL", "CLIMBMIX_LAST_SHARD",
    "SHIPPED_TOKENIZER_DIR", "budget_status", "charged_seconds", "median_step_seconds", "resume_ledger", "cache_root",
    "active_dataset_dir", "load_manifest", "split_shards", "check_shard", "_row_group_texts", "detect_device_type",
    "sha256_file", "atomic_write_bytes", "atomic_write_json", "HarnessError", "ConfigError", "DataError",
    "DownloadError", "BadShardError", "TokenizerError", "EvalRefused", "BudgetError",
]

if __name__ == "__main__":
    import gc
    from harness.cli import main
    code = main()
    gc.freeze()  # the interpreter's last collections skip what is alive now: torch's objects cost ~0.4 s at exit
    sys.exit(code)
