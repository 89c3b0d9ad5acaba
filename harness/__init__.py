"""The trusted harness of the trainium-frontier kit. `prepare.py` is its public face: train.py
imports the names of KIT section 3 from there, and `python prepare.py ...` runs the command line.

    config     the competition's constants and the environment variables the harness reads
    common     errors and small helpers (atomic writes, hashes, torchrun environment)
    download   robust downloads: retries, backoff, temp file, validation, atomic rename
    data       where the data lives, the manifest and its splits, data sources, `setup`
    tokenizer  the BPE tokenizer: training, the plain JSON artifact, its pin
    loader     documents, best-fit packing, make_dataloader
    ledger     the budget ledger: charged time, start-up allowance
    worker     the separate process that runs participant code (train.py, inference.py)
    metric     evaluate_bpb and the load-contract checks
    core       CORE (Phase 2): the bundle, prompts, decisions, verification
    cli        the command line: setup, eval-public, eval, eval-core

Modules import only those above them in this list, so there is no import cycle.
"""
