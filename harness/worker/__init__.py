"""The worker: a separate, sandboxed process that runs participant code. Its modules, by side:

    wire          both     the messages between the two ends; the logit dtypes and the check of a
                           model's output (logits_array)
    sandbox       both     the OS sandbox: the harness decides its rules, the worker applies them
    limits        both     what a worker may consume: the caps, the watchdog that enforces them, the
                           rlimits the worker sets; removing the folder a worker leaves
    harness_side  trusted  the harness's end: Worker, ModelForward, score_sequences, the worker's
                           environment, killing all it started
    worker_side   worker   the worker's end, `python -m harness.worker.worker_side FD`: runs beside
                           participant code; no harness module imports it

This file imports nothing: the worker process imports it on its way to worker_side."""
