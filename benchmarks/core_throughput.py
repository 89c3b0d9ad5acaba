"""CORE inference throughput of inference.py on this machine, before and after the prefix cache in
the same run: examples per second of the plain scorer (every sequence in full) and of the cached
one (each example's shared prefix once), the tokens each runs through the model (padded: the
work, whatever the machine), the largest loss difference between them, and the projected time of
the full bundle for each.

    python benchmarks/core_throughput.py [--checkpoint out/final.pt] [--examples 6]

The real bundle is not needed: each of the 22 CORE tasks is imitated with random words in its real
shape (type, shots, delimiter, number of choices, rough text lengths), and the projection weights
each task's measured seconds per example by its real size (about 92K examples in all). Without a
checkpoint, a randomly initialised CPU-preset model is used (speed does not depend on the weights).
Both scorers get the same sequences, examples_per_call examples per call, as the harness sends them."""
import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import inference  # noqa: E402
import prepare  # noqa: E402
from harness.core.bundle import Task  # noqa: E402
from harness.core.prompts import build_request  # noqa: E402
from harness.core.scoring import EXAMPLES_PER_CALL  # noqa: E402
from random_model import save_random_checkpoint  # noqa: E402

# label, type, shots, delimiter, examples in the real bundle, context words, choices, words per choice
CORE_TASKS = [
    ("hellaswag_zeroshot", "multiple_choice", 0, " ", 10042, 40, 4, 20),
    ("jeopardy", "language_modeling", 10, "\nAnswer: ", 2117, 25, 1, 2),
    ("bigbench_qa_wikidata", "language_modeling", 10, " ", 20321, 10, 1, 2),
    ("arc_easy", "multiple_choice", 10, "\nAnswer: ", 2376, 25, 4, 5),
    ("arc_challenge", "multiple_choice", 10, "\nAnswer: ", 2376, 30, 4, 6),
    ("copa", "multiple_choice", 0, " ", 100, 10, 2, 8),
    ("commonsense_qa", "multiple_choice", 10, " ", 1221, 30, 5, 1),
    ("piqa", "multiple_choice", 10, "\nAnswer: ", 1838, 12, 2, 20),
    ("openbook_qa", "multiple_choice", 0, " ", 500, 15, 4, 5),
    ("lambada_openai", "language_modeling", 0, " ", 5153, 70, 1, 1),
    ("hellaswag", "multiple_choice", 10, " ", 10042, 40, 4, 20),
    ("winograd", "schema", 0, " ", 273, 12, 2, 8),
    ("winogrande", "schema", 0, " ", 1267, 15, 2, 8),
    ("bigbench_dyck_languages", "language_modeling", 10, " ", 1000, 30, 1, 5),
    ("agi_eval_lsat_ar", "multiple_choice", 3, " ", 230, 200, 5, 1),
    ("bigbench_cs_algorithms", "language_modeling", 10, " ", 1320, 25, 1, 2),
    ("bigbench_operators", "language_modeling", 10, " ", 210, 15, 1, 1),
    ("bigbench_repeat_copy_logic", "language_modeling", 10, " ", 32, 20, 1, 10),
    ("squad", "language_modeling", 10, " ", 10570, 150, 1, 3),
    ("coqa", "language_modeling", 0, " ", 7983, 250, 1, 3),
    ("boolq", "multiple_choice", 10, "\nAnswer: ", 3270, 100, 2, 1),
    ("bigbench_language_identification", "multiple_choice", 10, " ", 10000, 15, 11, 1),
]
SHOT_POOL = 256  # imitated examples per task that few-shot examples are drawn from
WORDS = ("the of and to in is was for on that with as by at from he it his an were are which this be or had "
         "not but first one their its new after who they have her she two been other when there all during into "
         "school time may years more most only over city some world would where later up such used many can "
         "state about national out known university united then made").split()


def imitation(task_type, context_words, choices, choice_words, n, rng):
    def words(k):
        return " ".join(rng.choice(WORDS) for _ in range(max(1, k)))
    if task_type == "multiple_choice":
        return [{"query": words(context_words), "choices": [words(choice_words) for _ in range(choices)],
                 "gold": rng.randrange(choices)} for _ in range(n)]
    if task_type == "schema":
        return [{"context_options": [words(context_words) for _ in range(choices)], "continuation": words(choice_words),
                 "gold": rng.randrange(choices)} for _ in range(n)]
    return [{"context": words(context_words), "continuation": words(choice_words)} for _ in range(n)]


def score_task(scorer, tokenizer, task, data, n, per_call):
    """(seconds per example, every sequence's losses) for the first n examples of an imitated task
    (their shots drawn from all of data, as the harness draws them)."""
    label, task_type, shots, delim = task[:4]
    t = Task(label, task_type, shots, delim, "", 0.0)
    requests = [build_request(t, data, i, tokenizer, scorer.max_seq_len) for i in range(n)]
    losses = []
    t0 = time.perf_counter()
    for lo in range(0, len(requests), per_call):
        chunk = requests[lo:lo + per_call]
        losses += [l for l, _ in scorer.score([s for r in chunk for s in r.sequences])]
    return (time.perf_counter() - t0) / n, losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--examples", type=int, default=6, help="imitated examples per task")
    parser.add_argument("--examples-per-call", type=int, default=EXAMPLES_PER_CALL,
                        help="examples handed to score() at once (the harness's default)")
    parser.add_argument("--tasks", default=None, help="comma-separated task labels (default: all 22)")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    device = torch.device(args.device or prepare.detect_device_type())
    checkpoint = args.checkpoint or save_random_checkpoint("cpu", random_projections=True)
    tasks = CORE_TASKS
    if args.tasks:
        wanted = set(args.tasks.split(","))
        tasks = [t for t in CORE_TASKS if t[0] in wanted]
        if len(tasks) != len(wanted):
            raise SystemExit(f"error: --tasks: unknown {sorted(wanted - {t[0] for t in CORE_TASKS})}")
    model = inference.load_for_eval(checkpoint, device)
    scorers = {"plain": inference.Scorer(model, device, prefix_cache=False), "cached": inference.Scorer(model, device)}
    if not scorers["cached"].prefix_cache:
        raise SystemExit("error: the prefix cache is off for this model (the reason is printed above); there is "
                         "nothing to compare")
    tokenizer = prepare.ensure_tokenizer()
    rng = random.Random(0)
    warmup = imitation("multiple_choice", 20, 4, 5, 4, random.Random(1))
    for scorer in scorers.values():  # first-call allocations and kernel choices stay out of the timings
        score_task(scorer, tokenizer, CORE_TASKS[0], warmup, len(warmup), args.examples_per_call)
    projected = {mode: 0.0 for mode in scorers}
    projected_tokens = {mode: 0.0 for mode in scorers}
    measured = {mode: 0.0 for mode in scorers}
    count, worst = 0, 0.0
    dtype = str(model.compute_dtype or torch.float32).replace("torch.", "")
    print(f"model: {model.num_params() / 1e6:.1f}M parameters, max_seq_len {scorers['plain'].max_seq_len}, "
          f"device {device}, {dtype}, {args.examples_per_call} examples per call")
    for scorer in scorers.values():
        scorer.tokens_run = 0
    for task in tasks:
        # a pool as large as the task (up to SHOT_POOL), so examples share few-shot examples as rarely as
        # in the real bundle (shared shots are shared prefixes); the first --examples are scored
        n = max(1, min(args.examples, task[4] - 1))
        data = imitation(task[1], task[5], task[6], task[7], max(n, min(task[4], SHOT_POOL)), rng)
        seconds, losses, tokens = {}, {}, {}
        for mode, scorer in scorers.items():
            before = scorer.tokens_run
            seconds[mode], losses[mode] = score_task(scorer, tokenizer, task, data, n, args.examples_per_call)
            tokens[mode] = scorer.tokens_run - before
            projected[mode] += seconds[mode] * task[4]
            projected_tokens[mode] += tokens[mode] / n * task[4]
            measured[mode] += seconds[mode] * n
        diff = max(float((a - b).abs().max()) for a, b in zip(losses["plain"], losses["cached"]))
        worst = max(worst, diff)
        count += n
        print(f"{task[0]:<34} {task[4]:>6} examples | plain {1 / seconds['plain']:7.2f} ex/s | "
              f"cached {1 / seconds['cached']:7.2f} ex/s | x{seconds['plain'] / seconds['cached']:.2f} | "
              f"tokens /{tokens['plain'] / tokens['cached']:.2f} | max loss diff {diff:.2g}")
    print("---")
    print(f"examples_measured:             {count} per scorer")
    print(f"examples_per_second_plain:     {count / measured['plain']:.2f}")
    print(f"examples_per_second_cached:    {count / measured['cached']:.2f}")
    print(f"speedup:                       {measured['plain'] / measured['cached']:.2f}")
    print(f"tokens_per_example_plain:      {scorers['plain'].tokens_run / count:.0f} (padded)")
    print(f"tokens_per_example_cached:     {scorers['cached'].tokens_run / count:.0f} (padded)")
    print(f"max_loss_diff:                 {worst:.3g} nats")
    if len(tasks) == len(CORE_TASKS):
        print(f"projected_full_bundle_plain:   {projected['plain'] / 3600:.2f} h")
        print(f"projected_full_bundle_cached:  {projected['cached'] / 3600:.2f} h")
        print(f"full_bundle_tokens_plain:      {projected_tokens['plain'] / 1e6:.1f}M (padded)")
        print(f"full_bundle_tokens_cached:     {projected_tokens['cached'] / 1e6:.1f}M (padded)")


if __name__ == "__main__":
    main()
