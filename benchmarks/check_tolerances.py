"""What an honest model's numbers differ by, where the harness compares them: the measurements the
tolerances in harness/checks.py (TOLERANCE_NATS) and harness/core/verify.py (DECISION_ALLOWANCE_NATS)
rest on. For the kit's own model in fp32 and in bf16, on this machine's device:

- val_bpb checks, through the official command-line path (two sandboxed workers) and in process
  with many secrets: the largest honest difference of each kind (causality and batch content:
  same shape, another batch or worker; replay; batch size: a row alone);
- CORE: inference.py's answers (the prefix-cached scorer) against the trusted path's log-probs
  (train.py's model, batches of 4 padded to multiples of 64) on imitations of the 22 tasks: the
  largest per-token and per-mean difference, and the trusted margin of every decision the two
  disagree on;
- CORE's bias test (harness/core/verify.py, refuse_bias): every imitated example's lean towards
  its gold answer (inference.py's against the trusted path's), how many lean each way beyond
  BIAS_FLOOR_NATS, and the share of official-sized samples (2 % of each real task's examples, at
  least 8, drawn from these examples under --bias-runs secrets) that the sign tests would refuse.

    python benchmarks/check_tolerances.py --checkpoint out/final.pt [--secrets 10] [--examples 4] [--device cuda]

Uses the active dataset's public_val for the val_bpb rows. Without --checkpoint, a CPU-preset model
with random weights everywhere is used (its near-uniform outputs make a weak test: use a trained one)."""
import argparse
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import inference  # noqa: E402
import prepare  # noqa: E402
import train as T  # noqa: E402
from harness import checks  # noqa: E402
from harness.common import CoreError  # noqa: E402
from harness.core import verify  # noqa: E402  (a module: core_differences lifts its tolerances)
from harness.core.bundle import Task  # noqa: E402
from harness.core.prompts import Request, build_request  # noqa: E402
from harness.core.scoring import (VERIFY_FRACTION, Sample, claimed_near_tie, flip_worth,  # noqa: E402
                                  region_mean_losses, uniform_sample_size)
from harness import metric as M  # noqa: E402
from harness.submission import copy_submission  # noqa: E402
from random_model import save_random_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# CORE's 22 tasks: label, type, shots, delimiter, examples in the real bundle, context words, choices, words per choice
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


# each dtype forced, whatever the machine's default (a CPU without bf16 matmuls runs fp32)
COMPUTE_DTYPE = {"fp32": "None", "bf16": "torch.bfloat16"}
DEVICE = "cpu"  # where the model runs (--device)
DTYPE_OVERRIDE = '''

_kit_load_for_eval = load_for_eval


def load_for_eval(checkpoint_path, device):
    model = _kit_load_for_eval(checkpoint_path, device)
    model.compute_dtype = {dtype}
    return model
'''


def load(checkpoint: str, dtype: str):
    model = T.load_for_eval(checkpoint, torch.device(DEVICE))
    model.compute_dtype = torch.bfloat16 if dtype == "bf16" else None
    return model


def kit_copy(dtype: str) -> Path:
    """The kit's train.py (with load_for_eval forcing the dtype) and kernels/, in a temp folder."""
    folder = Path(tempfile.mkdtemp(prefix="tolerances-"))
    source = (REPO / "train.py").read_text()
    (folder / "train.py").write_text(source + DTYPE_OVERRIDE.format(dtype=COMPUTE_DTYPE[dtype]))
    shutil.copytree(REPO / "kernels", folder / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    return folder / "train.py"


def bpb_checks(checkpoint: str, dtype: str, tokenizer, secrets_count: int, max_tokens: int) -> dict:
    """The official path once (two sandboxed workers), then secrets_count evaluations' checks in process; each
    evaluation's line printed as it ends, so a run cut short keeps what it measured."""
    with copy_submission(kit_copy(dtype), checkpoint) as submission:
        cli = M.evaluate_checkpoint(submission, tokenizer, prepare.EVAL_BATCH_SIZE, prepare.EVAL_SEQ_LEN, DEVICE,
                                    max_tokens=max_tokens, timeout_seconds=M.EVAL_TIMEOUT_SECONDS)
    workers = {"causality": cli["causality_max_abs_diff"], "replay": cli["replay_max_abs_diff"],
               "batch_size": cli["batch_size_max_abs_diff"], "probes": cli["probes"], "twins": cli["twins"]}
    print(f"  two workers ({dtype}): " + ", ".join(f"{k} {v:.3g}" for k, v in workers.items()), flush=True)
    worst = {"causality": 0.0, "batch_content": 0.0, "replay": 0.0, "batch_size": 0.0}
    model = load(checkpoint, dtype)
    refused = probes = twins = 0
    for k in range(secrets_count):
        r = M.causality_check(model, tokenizer, prepare.EVAL_BATCH_SIZE, prepare.EVAL_SEQ_LEN, DEVICE,
                              max_rows=max_tokens // prepare.EVAL_SEQ_LEN)
        probes, twins = probes + r["probes"], twins + r["twins"]
        if not r["passed"]:
            refused += 1
            print(f"  REFUSED in process ({dtype}): {r['message']}")
        for kind, key in (("causality", "causal_max_abs_diff"), ("batch_content", "batch_content_max_abs_diff"),
                          ("replay", "replay_max_abs_diff"), ("batch_size", "batch_size_max_abs_diff")):
            worst[kind] = max(worst[kind], r[key])
        print(f"  in process, secret {k + 1} of {secrets_count} ({dtype}, {r['probes']} probes, {r['twins']} twins): "
              f"{'passed' if r['passed'] else 'REFUSED'}; largest differences so far " +
              ", ".join(f"{kind} {v:.3g}" for kind, v in worst.items()), flush=True)
    return {"in_process": worst, "refused": refused, "probes": probes, "twins": twins, "workers": workers}


class _Forward(M.LocalForward):
    def __init__(self, model, max_len: int):
        super().__init__(model, DEVICE, prepare.TOKENIZER_VOCAB_SIZE)
        self.batch_size, self.max_len = verify.VERIFY_BATCH_ROWS, max_len


def core_differences(checkpoint: str, dtype: str, tokenizer, examples: int) -> dict:
    # measure the honest differences in full, past the harness's tolerances (printed beside them)
    verify.VERIFY_LOSS_TOLERANCE = verify.VERIFY_GREEDY_TOLERANCE = verify.VERIFY_TOKEN_TOLERANCE = float("inf")
    verify.DECISION_ALLOWANCE_NATS = {"choice": float("inf"), "exact_match": float("inf")}
    model = load(checkpoint, dtype)
    scorer = inference.Scorer(model, torch.device(DEVICE))
    rng = random.Random(0)
    per_token = per_mean = greedy_gap = 0.0
    flips, decisions, leans = [], 0, {}
    for label, task_type, shots, delimiter, _, context_words, choices, choice_words in CORE_TASKS:
        leans[label] = []
        task = Task(label, task_type, shots, delimiter, "", 25.0)
        data = imitation(task_type, context_words, choices, choice_words, max(examples, shots + 1) + shots, rng)
        requests = [build_request(task, data, i, tokenizer, scorer.max_seq_len) for i in range(examples)]
        claimed = scorer.score([s for r in requests for s in r.sequences])
        k = 0
        for i, r in enumerate(requests):
            answer = claimed[k:k + len(r.sequences)]
            k += len(r.sequences)
            rows = [verify.TrustedRow(list(s), np.concatenate([np.asarray(s[1:])[:, None], np.asarray(a[1])[:, None]],
                                                              axis=1), (i, j))
                    for j, (s, a) in enumerate(zip(r.sequences, answer))]
            max_len = verify.padded_length(rows, 1 << 20)
            batches = [rows[b:b + verify.VERIFY_BATCH_ROWS] for b in range(0, len(rows), verify.VERIFY_BATCH_ROWS)]
            trusted = [lp for got in verify.run_rows(_Forward(model, max_len), batches, tokenizer.get_bos_token_id())
                       for lp in got]
            if any(e <= s for s, e in zip(r.starts, r.ends)):
                continue  # an imitation whose choices tokenize alike: nothing to score (real tasks have none)
            for (lp, *_), (loss, _), s, e in zip(trusted, answer, r.starts, r.ends):
                d = np.abs(-lp[:, 0].numpy() - np.asarray(loss, dtype=np.float64))[s - 1:e - 1]
                per_token = max(per_token, float(d.max()))
                per_mean = max(per_mean, abs(float(-lp[s - 1:e - 1, 0].mean()) -
                                             float(np.mean(np.asarray(loss, dtype=np.float64)[s - 1:e - 1]))))
            sample = Sample(task, r, answer, i)
            decisions += 1
            try:
                found = verify.trusted_decision_check(sample, trusted)  # the allowance is lifted (main)
                found["near"] = claimed_near_tie(task_type, r, answer)  # by the tolerances: scoring's stay
                found["lm"] = task_type == "language_modeling"
                greedy_gap = max(greedy_gap, found["greedy"])
                if found["flipped"]:
                    flips.append(found["margin_flipped"])
                found["lean_preferred"] = lean_towards_preferred(sample, trusted)
                leans[label].append(found)
            except CoreError as e:
                print(f"  REFUSED ({dtype}, {label}): {e}")
    return {"per_token": per_token, "per_mean": per_mean, "greedy_gap": greedy_gap, "decisions": decisions,
            "flips": sorted(flips), "leans": leans}


def lean_towards_preferred(sample: Sample, trusted: list) -> float:
    """The lean towards the choice the trusted path prefers, where it has one (else 0): on real
    tasks a model prefers the gold answer more often than not, so an inference.py that sharpened
    (or flattened) the model's own preferences would lean towards (or away from) the gold answer
    there; on the imitations, whose gold answers are drawn at random, this shows whether it does."""
    r = sample.request
    if sample.task.task_type == "language_modeling":
        return 0.0
    ours = region_mean_losses(r, [(-lp[:, 0].numpy(), None) for lp, *_ in trusted])
    theirs = region_mean_losses(r, sample.claimed)
    preferred = Request(r.sequences, r.starts, r.ends, ours.index(min(ours)))
    return verify.lean_towards_gold(Sample(sample.task, preferred, sample.claimed, sample.index), ours, theirs,
                                    trusted)


def official_sample_sizes() -> dict[str, int]:
    """The uniform sample per task in an official run on one rank (eval-core's uniform_sample_size)."""
    return {label: uniform_sample_size(n, flip_worth(n, RANDOM_BASELINE.get(label, 0.0), len(CORE_TASKS)),
                                       VERIFY_FRACTION) for label, _, _, _, n, *_ in CORE_TASKS}


def bias_false_refusals(leans: dict[str, list[dict]], runs: int, seed: int = 0) -> tuple[int, dict]:
    """How many of `runs` official-sized samples (each task's drawn with replacement from its
    measured examples) refuse_bias refuses, and the counts of all the examples together."""
    everything = {kind: [0, 0] for kind in verify.BIAS_COUNTS}
    for found in (f for task in leans.values() for f in task):
        verify.count_lean(everything, found)
    rng, refused = random.Random(seed), 0
    sizes = official_sample_sizes()
    for _ in range(runs):
        bias = {kind: [0, 0] for kind in verify.BIAS_COUNTS}
        for label, pool in leans.items():
            for found in (rng.choice(pool) for _ in range(sizes[label]) if pool):
                verify.count_lean(bias, found)
        try:
            verify.refuse_bias(bias)
        except CoreError:
            refused += 1
    return refused, everything


def decision_false_refusals(leans: dict[str, list[dict]], runs: int, seed: int = 0) -> tuple[int, dict]:
    """How many of `runs` official-sized verifications (each task's uniform sample, and all its claimed
    near-ties in the share measured here, scaled to the real task's size) the decision rules refuse: a
    verified decision that differs from the trusted path's by more than the allowance, or the sign
    tests. Also the near-tie share."""
    allowance = TOLERANCES["decision"]
    rng, refused, sizes = random.Random(seed), 0, official_sample_sizes()
    examples = {label: n for label, _, _, _, n, *_ in CORE_TASKS}
    share = {label: sum(f["near"] for f in pool) / max(len(pool), 1) for label, pool in leans.items()}
    for _ in range(runs):
        bias, wrong = {kind: [0, 0] for kind in verify.BIAS_COUNTS}, False
        for label, pool in leans.items():
            near = [f for f in pool if f["near"]]
            drawn = [rng.choice(pool) for _ in range(sizes[label])] if pool else []
            drawn += [rng.choice(near) for _ in range(round(share[label] * examples[label]))] if near else []
            for found in drawn:
                kind = "exact_match" if found.get("lm") else "choice"
                wrong |= found["flipped"] and not found["margin_flipped"] < allowance[kind]
                verify.count_lean(bias, found)
        try:
            verify.refuse_bias(bias)
            refused += wrong
        except CoreError:
            refused += 1
    return refused, share


# CORE v1's random baselines (percent), from the bundle's eval_meta_data.csv
RANDOM_BASELINE = {"hellaswag_zeroshot": 25, "arc_easy": 25, "arc_challenge": 25, "copa": 50, "commonsense_qa": 20,
                   "piqa": 50, "openbook_qa": 25, "hellaswag": 25, "winograd": 50, "winogrande": 50,
                   "agi_eval_lsat_ar": 20, "boolq": 62, "bigbench_language_identification": 9.1}


def official_coverage(share: dict[str, float]) -> dict:
    """verify.coverage for an official bundle on one rank whose tasks have the near-tie shares measured here."""
    sizes, tasks = official_sample_sizes(), {}
    for label, _, _, _, n, *_ in CORE_TASKS:
        tasks[label] = {"examples": n, "random_baseline": RANDOM_BASELINE.get(label, 0.0),
                        "verified": {"examples": n, "uniform": sizes[label], "near_ties_claimed": round(share[label] * n),
                                     "worth": flip_worth(n, RANDOM_BASELINE.get(label, 0.0), len(CORE_TASKS))}}
    found = verify.coverage(tasks, [{label: t["verified"] for label, t in tasks.items()}])
    found["examples_verified"] = sum(t["verified"]["uniform"] + t["verified"]["near_ties_claimed"] *
                                     (1 - t["verified"]["uniform"] / t["examples"]) for t in tasks.values())
    return found


TOLERANCES = {"loss": verify.VERIFY_LOSS_TOLERANCE, "greedy": verify.VERIFY_GREEDY_TOLERANCE,
              "token": verify.VERIFY_TOKEN_TOLERANCE,
              "decision": dict(verify.DECISION_ALLOWANCE_NATS)}  # the harness's, before core_differences lifts them


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--secrets", type=int, default=10)
    parser.add_argument("--examples", type=int, default=4, help="imitated examples per CORE task")
    parser.add_argument("--max-tokens", type=int, default=2**16)
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where the model runs")
    parser.add_argument("--bias-runs", type=int, default=10000, help="official-sized samples the bias test is run on")
    official = M.probe_counts(prepare.EVAL_TOKENS // prepare.EVAL_SEQ_LEN)[0]
    parser.add_argument("--probes", type=int, default=None,
                        help=f"probes per evaluation, however few rows are scored ({official}: an official run's; "
                             "default: as many as the rows would get)")
    parser.add_argument("--no-core", action="store_true", help="the val_bpb checks only")
    args = parser.parse_args()
    if args.probes:  # every row probed as often as it takes, at as many cut positions
        M.PROBE_FRACTION = args.probes / (args.max_tokens // prepare.EVAL_SEQ_LEN)
        M.EVAL_TIMEOUT_SECONDS = 24 * 3600  # an official run's probes on a CPU take longer than the scorer's limit
    global DEVICE
    DEVICE = args.device
    checkpoint = args.checkpoint or save_random_checkpoint("cpu", random_projections=True)
    tokenizer = prepare.ensure_tokenizer()
    torch.manual_seed(0)
    print(f"checkpoint: {checkpoint}")
    for dtype in args.dtypes.split(","):
        b = bpb_checks(checkpoint, dtype, tokenizer, args.secrets, args.max_tokens)
        print(f"--- {dtype} (tolerances {checks.TOLERANCE_NATS})")
        print(f"val_bpb, in process, {args.secrets} secrets ({b['probes']} probes, {b['twins']} twins): refused "
              f"{b['refused']}; largest differences " + ", ".join(f"{k} {v:.3g}" for k, v in b["in_process"].items()))
        print("val_bpb, two workers: " + ", ".join(f"{k} {v:.3g}" for k, v in b["workers"].items()))
        if args.no_core:
            continue
        c = core_differences(checkpoint, dtype, tokenizer, args.examples)
        print(f"CORE, inference.py vs trusted path: per token {c['per_token']:.3g}, per mean {c['per_mean']:.3g}, "
              f"greedy gap {c['greedy_gap']:.3g} nats; {len(c['flips'])} of {c['decisions']} decisions differ, "
              f"trusted margins {c['flips'][:8]} (harness: {TOLERANCES})")
        found = [f for task in c["leans"].values() for f in task]
        lean = np.array([f["lean"] for f in found])
        refused, counts = bias_false_refusals(c["leans"], args.bias_runs)
        print(f"CORE bias: {len(found)} examples, lean towards gold: mean {lean.mean():+.3g}, largest |lean| "
              f"{np.abs(lean).max():.3g} nats; beyond {verify.BIAS_FLOOR_NATS:g}: " +
              ", ".join(f"{kind} {t} towards / {a} away (p {verify.sign_test_p(t, a):.2g})"
                        for kind, (t, a) in counts.items()))
        preferred = [f["lean_preferred"] for f in found if abs(f["lean_preferred"]) > verify.BIAS_FLOOR_NATS]
        towards = sum(x > 0 for x in preferred)
        print(f"CORE lean towards the trusted path's own choice (choice tasks): {towards} towards / "
              f"{len(preferred) - towards} away (p {verify.sign_test_p(towards, len(preferred) - towards):.2g})")
        print(f"CORE bias test on {args.bias_runs} official-sized samples ({sum(official_sample_sizes().values())} "
              f"examples each): refused {refused} (refused below p {verify.BIAS_ALPHA:g} per count)")
        refused, share = decision_false_refusals(c["leans"], args.bias_runs)
        flipped = [f for f in found if f["flipped"]]
        print(f"CORE claimed near-ties: {sum(f['near'] for f in found)} of {len(found)} examples (per task: "
              + ", ".join(f"{label} {x:.0%}" for label, x in share.items()) + f"); {len(flipped)} decisions differ, "
              f"{sum(f['near'] for f in flipped)} of them claimed near-ties")
        print(f"CORE verification with the near-ties (allowance {TOLERANCES['decision']}) on "
              f"{args.bias_runs} official-sized runs: refused {refused}")
        cover = official_coverage(share)
        print(f"CORE coverage of an official bundle with these near-tie shares: about "
              f"{cover['examples_verified']:.0f} examples verified; at a {cover['risk']:.0%} chance of refusal a "
              f"forger gains at most CORE +{cover['bound']:.4f} (largest on {cover['task']})")


if __name__ == "__main__":
    main()
