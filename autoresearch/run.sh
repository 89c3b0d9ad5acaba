#!/usr/bin/env bash
# One experiment: train the kit's train.py on one core for a fixed budget (5 minutes unless
# AUTORESEARCH_BUDGET or --budget says otherwise), score it with prepare.py eval-public, append a
# row to results.tsv, keep the commit if val_bpb improved and reset to the best one otherwise.
#   git commit -am "what you changed" && bash run.sh
set -euo pipefail
cd "$(dirname "$0")"
exec "${PYTHON:-python}" loop.py run "$@"
