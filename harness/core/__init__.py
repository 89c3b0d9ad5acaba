"""CORE (Phase 2), the trusted side: the pinned eval bundle, prompts, tokenization, scored regions,
decisions, scores, and the verification that makes them trustworthy, exactly as nanochat
computes the DCLM CORE metric. Driven from the command line (command.py):

    python prepare.py eval-core --inference-py inference.py --checkpoint out/final.pt
    torchrun --standalone --nproc_per_node=8 prepare.py eval-core ...   # examples strided over 8 ranks

The participant's inference.py turns token sequences into per-position losses and greedy
predictions, in a worker process (harness/worker/); everything that depends on the task happens
here. Its answers are not taken on trust: a secret random sample of the examples it scored (every
sequence of each sampled example, in every task) is scored again through the trusted path
(train.py's load_for_eval in a model worker, losses and argmax computed here from its logits),
and one sequence of each sampled example is also cut at a secret point inside its scored region
and continued with other text, to check the model does not read ahead. A disagreement beyond a
tolerance well below decision margins refuses the run.

Semantics (nanochat core_eval.py / base_eval.py):
- each task's examples are shuffled with random.Random(1337), then capped at --max-per-task;
- example idx gets few-shot examples random.Random(1234 + idx).sample(all indices but idx, k);
- prompts: multiple choice renders one prompt per choice, schema one per context option,
  language modelling one prompt without and one with the continuation; BOS goes in front;
- scored region: the tokens after the common prefix (multiple choice), the common suffix
  (schema), or the continuation (language modelling); longer sequences keep their last
  max_seq_len tokens;
- multiple choice and schema pick the option with the lowest mean loss over its region (first on
  ties); language modelling is correct when greedy predictions match the continuation exactly;
- centered accuracy = (accuracy - 0.01 * baseline) / (1 - 0.01 * baseline) with the bundle's
  random baselines (percent); CORE = the mean over the tasks.

The modules, each importing only those above it:

    bundle    the pinned archive or a local folder, its tasks and their examples
    prompts   shuffling, few-shot sampling, rendering, scored regions, truncation: build_request
    scoring   decisions, centered accuracy, evaluate_core (through inference.py) and its secret sample
    verify    the secret sample scored again through the trusted path, and the comparison
    command   `prepare.py eval-core`: its arguments, its workers, its report

This file imports nothing (callers import the module they need).
"""
