#!/usr/bin/env bash
# Train the queued commits (or HEAD, if none is queued) of the kit's train.py, up to --slots at once
# (default 1), each for a fixed budget (5 minutes unless AUTORESEARCH_BUDGET or --budget says
# otherwise), score each with prepare.py eval-public, append a row per experiment to results.tsv,
# and keep the branch at the best commit.
#   git commit -am "what you changed" && bash run.sh                      # one experiment
#   python loop.py queue  (after each idea's commit) ... && bash run.sh --slots 8 --wait
set -euo pipefail
cd "$(dirname "$0")"
exec "${PYTHON:-python}" loop.py run "$@"
