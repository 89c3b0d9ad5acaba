"""The trusted harness of the trainium-frontier kit. `prepare.py` is its public face: train.py
imports the names of the organisers' kit (and the kit's own additions) from there, and
`python prepare.py ...` runs the command line.

The modules, in import order: each imports only modules above it in this list, so there is no
import cycle, and none imports a module of the worker side (tests/test_layout.py checks both).
The side says where a module's job is done: trusted, in the harness's own process, which computes
the results; worker, in a worker process beside participant code, where the harness relies on
nothing; both, a module with a part for each end. (A worker runs its own copy of the kit, and
participant code there may import any of it: that copy is trusted by nobody.)

    common               trusted  errors and small helpers (atomic writes, hashes, torchrun environment)
    config               trusted  the competition's constants and the environment variables the harness reads
    download             trusted  robust downloads: retries, backoff, temp file, validation, atomic rename
    data                 trusted  where the data lives, the manifest and its splits, data sources, `setup`
    tokenizer            trusted  the BPE tokenizer: training, the plain JSON artifact, its pin
    loader               trusted  documents, best-fit packing, make_dataloader
    ledger               trusted  the budget ledger: charged time, start-up allowance
    submission           trusted  the harness's private copy of the participant's files, hashed
    worker.wire          both     the messages between harness and worker; the logit dtypes and logits_array
    worker.sandbox       both     the worker's OS sandbox: the harness's rules, applied in the worker
    worker.limits        both     what a worker may consume (its caps, the watchdog), its rlimits; removing its folder
    worker.kernel_caps   trusted  the caps the kernel enforces: a cgroup (memory, processes) and a tmpfs per worker
    worker.access_times  trusted  reading ahead what a worker's reads would mark (access times), where no noatime
    worker.harness_side  trusted  the harness's end of a worker: Worker, ModelForward, score_sequences
    worker.worker_side   worker   the worker process (`python -m harness.worker.worker_side FD`)
    checks               trusted  the log-prob checks and tolerances metric and CORE share
    metric               trusted  evaluate_bpb and the load-contract checks
    core.bundle          trusted  CORE (Phase 2): the pinned eval bundle, its tasks and examples
    core.prompts         trusted  CORE's prompts: shuffling, few-shot, rendering, scored regions
    core.scoring         trusted  CORE's decisions and score through inference.py (evaluate_core)
    core.verify          trusted  CORE's verification through the trusted path
    core.command         trusted  the eval-core command
    cli                  trusted  the command line: setup, eval-public, eval, eval-core

The packages' own files (this one, worker/__init__.py, core/__init__.py) import nothing.
"""
