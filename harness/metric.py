"""The official metric, evaluate_bpb, and the load-contract checks that come with it (the
log-prob checks it shares with CORE live in harness/checks.py).

val_bpb = total_nats / (ln 2 * total_bytes) over a fixed list of validation rows (BOS-aligned
best-fit rows of EVAL_SEQ_LEN + 1 tokens, in file order), with cross-entropy recomputed here in
fp32 from the logits the model returns, targets of byte length 0 (special tokens) left out.

The model is untrusted, so the contract is checked on the same kind of rows that are scored:
- probes are twins of scored rows, drawn from a secret per-run seed: the same row with everything
  from a secret cut point on replaced by other real validation text (causality: every log-prob
  before the cut must agree), or the same row again in another batch (batch independence); cut
  points run through every position of the row over a run;
- two passes, for the command line two worker processes one after the other: the first scores
  every row, the second runs every probe, a replay of one first-pass batch (the same batch must
  give the same answer) and one row alone (the batch size must not matter, up to rounding). A
  probe never runs before, or beside, its original, so neither worker can answer a probe from
  memory of its original;
- probes travel in batches of the scoring shape, each at its original's batch index (a twin has
  its original's length, padding, batch size and place in the batch: an honest model computes it
  with the same kernels);
- log-probs are computed here, exactly for any finite logits (harness/checks.py), so every
  difference and sum is a number, and every check is "refuse unless |difference| <= tolerance";
- tolerances are absolute, on log-softmax values, the same for every model (TOLERANCE_NATS);
  compared are the log-prob of the row's own target and of a few secret token ids at every position.
The comparisons use log-softmax values computed here from logits the model returned, so a value
the model controls (like the size of its largest logit, or the dtype it says it computes in) never
widens a tolerance.

Two ways in: the command line (`prepare.py eval-public` / `eval`) runs the participant's model in
sandboxed worker processes (harness/worker/) and is the official number; evaluate_bpb(model, ...)
runs a model in the caller's process, both passes on the same model, for train.py's own end-of-run
figure (informational: the participant's code shares that process). Both use the same rows, checks
and arithmetic, so an honest model gets the same number from both. Under torchrun, rows are strided
over ranks and the per-row sums are gathered and added in row order: the same number at any world
size.
"""
from __future__ import annotations

import collections
import contextlib
import math
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from harness.checks import TOLERANCE_NATS, CheckLog, checked_log_probs, compare_log_probs
from harness.common import DataError, EvalRefused, HarnessError
from harness.config import EVAL_SEQ_LEN, EVAL_TIMEOUT_SECONDS, EVAL_TOKENS, SPECIAL_TOKENS, keep_kernel_caches
from harness.data import check_shard, read_pinned_shard, shard_pin, source_folder, split_shards
from harness.loader import pack_rows, shard_document_batches, tokenized_documents
from harness.submission import Submission
from harness.tokenizer import Tokenizer, get_token_bytes
from harness.worker.harness_side import ModelForward, Worker, drop_kernel_caches
from harness.worker.wire import WorkerTimeout, logits_array

# Probes per scored row: the official 20,480 rows get 3,414, of which 3,201 twins. They catch a model
# that reads ahead at >= 0.14 % of the positions in 99 % of runs (read_ahead_caught), and reading ahead
# at 0.14 % gains at most 0.42 % of val_bpb, even at the positions of the highest loss (measured with
# benchmarks/probe_coverage.py, kept in commit 95cf4ea: a CPU-preset model trained 2 minutes, 2^19 tokens;
# 0.5 % needs 2,694 twins there, and 1,413 where the model picks the positions by its own entropy).
PROBE_FRACTION = 1 / 6
MIN_PROBES = 16  # at least this many probes, however few rows are scored (a small run says how little they catch)
REPEAT_SHARE = 1 / 16  # of the probes, this share repeats the whole row (batch independence); the rest are
                       # twins cut at a position (official run: every one of the 1,023 positions is cut 3 or 4 times)
SECRET_TOKEN_IDS = 8  # token ids compared at every position, besides the row's own target
CAUGHT_IN = 0.99  # probe coverage is stated as the smallest read-ahead share caught in this share of runs


def probe_counts(rows: int) -> tuple[int, int]:
    """(probes, twins) planned for a rank that scores `rows` rows."""
    count = max(MIN_PROBES, math.ceil(rows * PROBE_FRACTION))
    return count, count - int(count * REPEAT_SHARE)


def read_ahead_caught(twins: int) -> float:
    """The smallest share f of positions at which a model may read ahead and still be caught in
    CAUGHT_IN of runs by `twins` twins. A twin cut at c tests position c - 1 of a secret row, the
    one whose next token it changes, so it misses a model that reads ahead at a share f of the
    positions with probability 1 - f, and every twin misses it with at most (1 - f)^twins (drawn
    without replacement, they miss together less often than independent draws would)."""
    return 1.0 - (1.0 - CAUGHT_IN) ** (1.0 / twins) if twins > 0 else 1.0


def official_twins() -> int:
    """The twins of an official run: EVAL_TOKENS at EVAL_SEQ_LEN, the rows on one rank or shared out
    (each rank plans its share of the probes, and the shares add up to the same count)."""
    return probe_counts(EVAL_TOKENS // EVAL_SEQ_LEN)[1]


def probe_coverage(twins: int) -> str:
    """What `twins` twins catch, in words; a run with fewer than an official run's says so."""
    said = f"reading ahead at >= {100 * read_ahead_caught(twins):.2g} % of positions is caught in " \
           f"{100 * CAUGHT_IN:.0f} % of runs ({twins} twins)"
    official = official_twins()
    if twins < official:
        said += f"; fewer twins than an official run's {official}, which catch >= " \
                f"{100 * read_ahead_caught(official):.2g} %"
    return said


@dataclass
class Probe:
    row: int  # index into this rank's rows
    cut: int  # positions [0, cut) must agree; cut == seq_len: the whole row (a repeat); 0: a filler, not compared
    inputs: np.ndarray  # int32 [seq_len]: the row's inputs up to the cut, other text after it


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------

def evaluation_rows(tokenizer: Tokenizer, seq_len: int, max_tokens: int, shards: list[tuple[Path, str | None]]
                    ) -> tuple[np.ndarray, list[str]]:
    """The fixed rows of an evaluation, int32 [rows, seq_len + 1] (BOS-aligned best-fit packing of
    the shards' documents in file order, at most max_tokens // seq_len rows), and the SHA-256 of
    each shard. shards: (path, pin); each is read once, checked against its pin (None: no pin),
    and parsed from the bytes that were hashed."""
    max_rows = max_tokens // seq_len
    if max_rows < 1:
        raise ValueError(f"max_tokens={max_tokens} is less than one row of seq_len={seq_len}")
    blobs, digests = [], []
    for path, pin in shards:
        blob, digest = read_pinned_shard(path, pin)
        check_shard(path, data=blob)
        blobs.append(blob)
        digests.append(digest)
    docs = tokenized_documents(shard_document_batches(blobs), tokenizer, num_threads=4)
    rows = []
    for row, _ in pack_rows(docs, seq_len + 1, buffer_size=1000):
        rows.append(row)
        if len(rows) == max_rows:
            break
    if not rows:
        raise DataError(f"no bytes were scored: the validation data ({', '.join(str(p) for p, _ in shards)}) holds "
                        f"no complete row of {seq_len + 1} tokens")
    return np.stack(rows), digests


# ---------------------------------------------------------------------------------------------
# Forwards: the model in this process, or in a worker
# ---------------------------------------------------------------------------------------------

class LocalForward:
    """model(rows) in this process (the informational path). The model gets a private copy of its
    inputs; the logits come back as a private float32 array, checked like the worker's."""

    def __init__(self, model, device, vocab_size: int):
        self.model, self.device, self.vocab = model, torch.device(device), vocab_size
        self.pending: collections.deque = collections.deque()

    def submit(self, rows: np.ndarray) -> None:
        x = torch.from_numpy(np.array(rows, dtype=np.int64)).to(self.device)
        with torch.no_grad():
            out = self.model(x)
        self.pending.append(np.array(logits_array(out, x.shape[0], x.shape[1], self.vocab), copy=True))

    def result(self) -> np.ndarray:
        return self.pending.popleft()


# ---------------------------------------------------------------------------------------------
# Scoring with the checks: two passes, and the probes of a row never in the pass that scores it
# ---------------------------------------------------------------------------------------------

@dataclass
class Batch:
    """One forward: scored rows (indices into the rows), then probes, in that order."""
    rows: list[int]
    probes: list[Probe]
    inputs: np.ndarray  # int32 [n, seq_len]
    purpose: str = "score"  # score, replay (a batch of the first pass sent again) or alone (one row, batch size 1)
    keep: bool = False  # keep this batch's log-probs: the second pass replays it


class _Scorer:
    """This rank's rows and their secret probes, in two passes, each through its own forward (for
    the command line: a fresh worker process that shares nothing with the other). The first pass
    scores every row; only then does the second run every probe (twins, repeats, a replayed batch,
    a row alone). So information can only flow forward: the first worker cannot know which rows
    will be probed or where they will be cut, and the second, which sees nothing but probes, has
    never seen an original, so it cannot know what a model that reads ahead answered there. Keeps
    the per-row sums; raises EvalRefused at the first broken check."""

    PASSES = 2

    def __init__(self, rows: np.ndarray, token_bytes: np.ndarray, batch_size: int, num_ordinary: int,
                 deadline: float, rng: np.random.Generator, cuts: np.ndarray | None = None):
        """cuts: the cut positions this scorer cycles through (default: every position, shuffled)."""
        if len(rows) == 0:
            raise HarnessError("no rows to score on this rank: score more tokens (--max-tokens) or run fewer ranks")
        self.rows, self.B, self.T = rows, batch_size, rows.shape[1] - 1
        self.token_bytes, self.deadline, self.rng = token_bytes, deadline, rng
        self.secret_ids = rng.choice(num_ordinary, size=SECRET_TOKEN_IDS, replace=False).astype(np.int64)
        R = len(rows)
        self.nats = np.zeros(R, dtype=np.float64)
        self.bytes = np.zeros(R, dtype=np.int64)
        self.tokens = np.zeros(R, dtype=np.int64)
        self.checks = CheckLog()
        self.cuts = rng.permutation(np.arange(1, self.T)) if cuts is None else cuts
        self.probes = self._plan_probes()
        batches = [list(range(i, min(i + batch_size, R))) for i in range(0, R, batch_size)]
        full = [j for j, rows_ in enumerate(batches) if len(rows_) == batch_size] or list(range(len(batches)))
        self.batches, self.replay_at = batches, int(rng.choice(full))
        self.alone = int(rng.integers(R))  # runs alone (batch size 1) in the second pass
        self.needed = {p.row for p in self.probes} | {self.alone}  # rows whose log-probs are kept as references
        self.references: dict[int, torch.Tensor] = {}  # row -> log-probs at its compare ids [T, 1 + K]
        self.in_flight: collections.deque[Batch] = collections.deque()
        self.kept: tuple[Batch, torch.Tensor] | None = None
        self.pass_seconds: list[float] = []

    # --- the secret plan ------------------------------------------------------------------------

    def _plan_probes(self) -> list[Probe]:
        """Which rows get probes (a secret sample, as many at each batch index: a probe runs at its
        row's), which are twins and where they are cut (the cycle of cut positions, so a run with as
        many twins as positions cuts at every one), and which other text follows each cut."""
        R = len(self.rows)
        count, twins = probe_counts(R)
        twins = twins if len(self.cuts) else 0
        by_slot = [self.rng.permutation(np.arange(s, R, self.B)) for s in range(min(self.B, R))]
        slots = self.rng.permutation(len(by_slot))  # which indices get the extra probe (fewer probes than slots: any)
        probes = []
        for k in range(count):
            pool = by_slot[slots[k % len(by_slot)]]
            row = int(pool[(k // len(by_slot)) % len(pool)])
            cut = int(self.cuts[k % len(self.cuts)]) if k < twins else self.T
            twin = self._twin(row, cut) if k < twins else None
            probes.append(Probe(row, cut, twin) if twin is not None else self._repeat(row))
        return probes

    def _twin(self, row: int, cut: int) -> np.ndarray | None:
        """The row's inputs before cut, then real text from other rows: the same positions of
        another row if its token at the cut differs from this row's, else a stretch of two other
        rows whose first token differs. So a model that reads ahead shows it at position cut - 1."""
        inputs, R, T = self.rows[row, :self.T], len(self.rows), self.T
        for donor in self.rng.permutation(R)[:64].tolist():
            if donor == row:
                continue
            if self.rows[donor, cut] != inputs[cut]:
                return np.concatenate([inputs[:cut], self.rows[donor, cut:T]])
            text = self.rows[[donor, (donor + 1) % R], :T].reshape(-1)
            for start in self.rng.integers(0, T, size=8).tolist():
                if text[start] != inputs[cut]:
                    return np.concatenate([inputs[:cut], text[start:start + T - cut]])
        return None

    def _repeat(self, row: int) -> Probe:
        return Probe(row, self.T, self.rows[row, :self.T].copy())

    # --- forwards -------------------------------------------------------------------------------

    def _submit(self, forward, batch: Batch) -> None:
        if len(self.in_flight) == 2:
            self._collect(forward)
        forward.submit(batch.inputs)
        self.in_flight.append(batch)

    def _drain(self, forward) -> None:
        while self.in_flight:
            self._collect(forward)

    def _collect(self, forward) -> None:
        batch = self.in_flight.popleft()
        logits = forward.result()
        if time.monotonic() > self.deadline:
            raise WorkerTimeout("past the evaluation's time limit")
        own = [self.rows[r, 1:] for r in batch.rows] + [self.rows[p.row, 1:] for p in batch.probes]
        targets = np.stack(own)  # a twin is compared at its original row's targets
        ids = np.concatenate([targets[..., None].astype(np.int64),
                              np.broadcast_to(self.secret_ids, (*targets.shape, SECRET_TOKEN_IDS))], axis=-1)
        lp = self._log_probs(logits, batch, ids)
        if batch.purpose == "replay":
            kept_batch, kept = self.kept
            for i in range(len(lp)):
                compare_log_probs("replay", lp[i], kept[i], TOLERANCE_NATS["same_shape"], self.checks,
                                  f"row {i} of a first-pass batch run again in the second pass")
            return
        if batch.purpose == "alone":
            return compare_log_probs("batch_size", lp[0], self.references[batch.rows[0]],
                                     TOLERANCE_NATS["batch_size"], self.checks, f"row {batch.rows[0]} run as a batch of 1")
        for i, row in enumerate(batch.rows):
            nbytes = self.token_bytes[targets[i]]
            counted = torch.from_numpy(nbytes > 0)
            self.nats[row] = -float(lp[i][:, 0][counted].double().sum())
            self.bytes[row] = int(nbytes.sum())
            self.tokens[row] = int(counted.sum())
            if row in self.needed:
                self.references[row] = lp[i].clone()
        for i, probe in enumerate(batch.probes, start=len(batch.rows)):
            if probe.cut > 0:  # a filler (cut 0) only pads a short batch of the first pass
                self._check_probe(probe, lp[i])
        if batch.keep:
            self.kept = (batch, [x.clone() for x in lp])

    def _log_probs(self, logits: np.ndarray, batch: Batch, ids: np.ndarray) -> list[torch.Tensor]:
        """Per row of the batch, its log-probs at its compare ids [n, 1 + K] where the checks use
        them: a scored row, a repeat and every row of a replayed or lone batch in full; a twin
        before its cut (nothing after the cut is compared, so a twin costs the harness only its
        prefix); a filler nowhere, unless its batch is kept (the replay compares every row of it in
        full). Logits that are never used are never read."""
        if batch.purpose != "score" or batch.keep:
            return list(checked_log_probs(logits, ids))
        upto = [self.T] * len(batch.rows) + [p.cut for p in batch.probes]
        if all(n == self.T for n in upto):
            return list(checked_log_probs(logits, ids))
        return [checked_log_probs(logits[i, :n], ids[i, :n]) if n else torch.empty(0, ids.shape[-1], dtype=torch.float64)
                for i, n in enumerate(upto)]

    def _check_probe(self, probe: Probe, lp: torch.Tensor) -> None:
        whole = probe.cut == self.T
        compare_log_probs("batch_content" if whole else "causality", lp[:probe.cut],
                          self.references[probe.row][:probe.cut], TOLERANCE_NATS["same_shape"], self.checks,
                          f"row {probe.row} sent again in another batch" if whole
                          else f"row {probe.row} cut at position {probe.cut}")
        self.checks.probes += 1
        if not whole:
            self.checks.twins += 1
            self.checks.cut_positions.add(probe.cut)

    # --- the passes -----------------------------------------------------------------------------

    def _inputs(self, rows: list[int], probes: list[Probe]) -> np.ndarray:
        return np.concatenate([self.rows[rows, :self.T]] + [p.inputs[None] for p in probes])

    def _probe_batches(self) -> list[list[Probe]]:
        """The second pass's batches: every probe at its row's batch index (row % B), in a random
        order; a place with no probe left holds a repeat of a probed row of that index (itself a
        probe), or, where no row has that index (fewer rows than B), a filler as in the first pass."""
        B, R = self.B, len(self.rows)
        at_slot = [[] for _ in range(B)]
        for i in self.rng.permutation(len(self.probes)).tolist():
            at_slot[self.probes[i].row % B].append(self.probes[i])
        probed = [sorted(r for r in self.needed if r % B == s) for s in range(B)]

        def spare(s: int) -> Probe:
            if probed[s]:
                return self._repeat(int(self.rng.choice(probed[s])))
            return Probe(s % R, 0, self.rows[s % R, :self.T])

        return [[at_slot[s][i] if i < len(at_slot[s]) else spare(s) for s in range(B)]
                for i in range(max(len(p) for p in at_slot))]

    def run_pass(self, k: int, forward) -> None:
        """Pass 0 through forward: every row, in row order, in batches of B (a short last batch
        filled with copies of its own rows, not compared). Pass 1: every probe at its row's batch
        index, in batches of B at random, then a first-pass batch replayed and one row alone."""
        t0 = time.time()
        B = self.B
        if k == 0:
            for j, rows in enumerate(self.batches):
                filler = [Probe(rows[i % len(rows)], 0, self.rows[rows[i % len(rows)], :self.T])
                          for i in range(B - len(rows))]
                self._submit(forward, Batch(rows, filler, self._inputs(rows, filler), keep=j == self.replay_at))
        else:
            for batch in self._probe_batches():
                self._submit(forward, Batch([], batch, self._inputs([], batch)))
            kept = self.kept[0]
            self._submit(forward, Batch(kept.rows, kept.probes, kept.inputs, purpose="replay"))
            self._submit(forward, Batch([self.alone], [], self.rows[[self.alone], :self.T], purpose="alone"))
        self._drain(forward)
        self.pass_seconds.append(time.time() - t0)

    def run(self, open_pass) -> None:
        """Both passes in one process; open_pass(k) is a context manager giving the forward of pass
        k. (score() runs them one by one, in step with the other ranks.)"""
        for k in range(self.PASSES):
            with open_pass(k) as forward:
                self.run_pass(k, forward)


# ---------------------------------------------------------------------------------------------
# The evaluation
# ---------------------------------------------------------------------------------------------

def _gloo_group():
    """A CPU process group for the harness's own sums: the default one if it is gloo, else a new gloo
    group (created once, on every rank: evaluate_bpb is called on every rank under torchrun)."""
    import torch.distributed as dist
    global _GLOO
    if dist.get_backend() == "gloo":
        return None
    if _GLOO is None:
        _GLOO = dist.new_group(backend="gloo")
    return _GLOO


_GLOO = None


def _distributed() -> tuple[int, int]:
    """(rank, world size) of the running process group, (0, 1) without one."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shared_secret(world: int) -> int:
    """A secret drawn on rank 0 and shared by the harness processes: every rank cuts at its own
    share of one shuffled cycle of positions, so the run as a whole cuts at every position."""
    secret = [secrets.randbits(128)]
    if world > 1:
        import torch.distributed as dist
        dist.broadcast_object_list(secret, src=0, group=_gloo_group())
    return secret[0]


def _between_passes(status: str, world: int, then) -> bool:
    """Whether to run the second pass, the same answer on every rank: every rank's first pass is over
    (its worker and all it started are dead) before any rank goes on, and only if every one was ok.
    Then then() runs on every rank, and no second pass starts before every rank's then() is done."""
    statuses = [status]
    if world > 1:
        import torch.distributed as dist
        statuses = [None] * world
        dist.all_gather_object(statuses, status, group=_gloo_group())
    if any(s != "ok" for s in statuses):
        return False
    then()
    if world > 1:
        dist.barrier(group=_gloo_group())
    return True


def _gather_outcome(outcome: dict, world: int) -> list[dict]:
    if world == 1:
        return [outcome]
    import torch.distributed as dist
    gathered = [None] * world
    dist.all_gather_object(gathered, outcome, group=_gloo_group())
    return gathered


def score(open_pass, rows: np.ndarray, tokenizer: Tokenizer, batch_size: int, timeout_seconds: float,
          t0: float, deadline: float, between_passes=lambda: None) -> dict:
    """Score the rows of this rank (strided over the process group, if any) with the checks, in
    the scorer's two passes (open_pass(k): a context manager giving pass k's forward;
    between_passes() runs on every rank once every rank's first pass is over), gather every rank's
    per-row sums and add them in row order. EvalRefused on every rank if any rank found a broken check."""
    rank, world = _distributed()
    if len(rows) < world:
        raise HarnessError(f"{len(rows)} rows for {world} ranks: every rank needs a row; score more tokens "
                           "(--max-tokens) or run fewer ranks")
    mine = np.arange(rank, len(rows), world)
    vocab = tokenizer.get_vocab_size()
    token_bytes = get_token_bytes("cpu", tokenizer).numpy().astype(np.int64)
    cuts = np.random.default_rng(_shared_secret(world)).permutation(np.arange(1, rows.shape[1] - 1))[rank::world]
    scorer = _Scorer(rows[mine], token_bytes, batch_size, vocab - len(SPECIAL_TOKENS), deadline,
                     np.random.default_rng(secrets.randbits(128)), cuts)
    status, message = "ok", ""
    for k in range(scorer.PASSES):
        if k > 0 and not _between_passes(status, world, between_passes):
            break
        try:
            with open_pass(k) as forward:
                scorer.run_pass(k, forward)
        except EvalRefused as e:
            status, message = "refused", str(e)
        except WorkerTimeout:
            status = "timeout"
    outcome = {"status": status, "message": message, "rows": mine, "nats": scorer.nats, "bytes": scorer.bytes,
               "tokens": scorer.tokens, "worst": scorer.checks.worst, "probes": scorer.checks.probes,
               "twins": scorer.checks.twins,
               "cuts": sorted(scorer.checks.cut_positions), "pass_seconds": scorer.pass_seconds}
    everyone = _gather_outcome(outcome, world)
    refused = [o["message"] for o in everyone if o["status"] == "refused"]
    if refused:
        raise EvalRefused(refused[0])
    over = any(o["status"] == "timeout" for o in everyone)
    nats = np.zeros(len(rows), dtype=np.float64)
    nbytes = np.zeros(len(rows), dtype=np.int64)
    tokens = np.zeros(len(rows), dtype=np.int64)
    for o in everyone:
        nats[o["rows"]], nbytes[o["rows"]], tokens[o["rows"]] = o["nats"], o["bytes"], o["tokens"]
    total_nats, total_bytes = float(math.fsum(nats.tolist())), int(nbytes.sum())
    seconds = time.time() - t0
    over = over or time.monotonic() > deadline
    bpb = total_nats / (math.log(2) * total_bytes) if total_bytes else float("nan")
    worst = {k: max(o["worst"][k] for o in everyone) for k in everyone[0]["worst"]}
    twins = sum(o["twins"] for o in everyone)
    return {"val_bpb": float("nan") if over else bpb, "partial_val_bpb": bpb if over else None,
            "total_nats": total_nats, "total_bytes": total_bytes, "tokens": int(tokens.sum()), "rows": len(rows),
            "seq_len": rows.shape[1] - 1, "batch_size": batch_size, "eval_seconds": seconds,
            "eval_timeout": timeout_seconds, "eval_over_timeout": over, "world_size": world,
            "causality_passed": True, "causality_max_abs_diff": max(worst["causality"], worst["batch_content"]),
            "batch_size_max_abs_diff": worst["batch_size"], "replay_max_abs_diff": worst["replay"],
            "probes": sum(o["probes"] for o in everyone), "twins": twins,
            "read_ahead_caught": read_ahead_caught(twins), "probe_coverage": probe_coverage(twins),
            "cut_positions": len(set().union(*(o["cuts"] for o in everyone))),
            "pass_seconds": [max(o["pass_seconds"][k] for o in everyone) for k in range(len(scorer.pass_seconds))],
            "tolerances": TOLERANCE_NATS}


def scored_shards(split: str, shard_path=None, shard_sha256: str | None = None) -> list[tuple[Path, str | None]]:
    """(path, pin) of the shards an evaluation scores: a split's, pinned by its manifest, or one
    given shard, pinned by shard_sha256 if given."""
    if shard_path is not None:
        path = Path(shard_path)
        if not path.is_file():
            raise HarnessError(f"{path}: no such shard")
        return [(path, shard_sha256)]
    return [(path, shard_pin(path)) for path in split_shards(split)]


@contextlib.contextmanager
def _in_process(model, device, vocab_size: int):
    """Both passes of the in-process path run the caller's model (informational: it remembers
    whatever it likes)."""
    yield LocalForward(model, device, vocab_size)


def evaluate_bpb(model, tokenizer: Tokenizer, batch_size: int, seq_len: int, device, split: str = "public_val",
                 max_tokens: int = EVAL_TOKENS, timeout_seconds: float = EVAL_TIMEOUT_SECONDS, *,
                 shard_path=None) -> dict:
    """Validation bits per byte of a model in this process (train.py's end-of-run figure): the same
    rows, checks and arithmetic as the official command line, which runs the model in two worker
    processes. Under torchrun call it on every rank with the same arguments: the rows are shared
    out and the result is the same on every rank and at every world size. EvalRefused if the model
    breaks the load contract; past timeout_seconds, eval_over_timeout and val_bpb = nan."""
    t0 = time.time()
    deadline = time.monotonic() + timeout_seconds
    if hasattr(model, "eval"):
        model.eval()
    shards = scored_shards(split, shard_path)
    rows, digests = evaluation_rows(tokenizer, seq_len, max_tokens, shards)
    vocab = tokenizer.get_vocab_size()
    result = score(lambda k: _in_process(model, device, vocab), rows, tokenizer, batch_size, timeout_seconds, t0,
                   deadline)
    result.update(max_tokens=max_tokens, split=split if shard_path is None else "shard",
                  shards=[str(p) for p, _ in shards], shard_sha256=digests, isolated=False)
    return result


def evaluate_checkpoint(submission: Submission, tokenizer: Tokenizer, batch_size: int, seq_len: int, device, *,
                        split: str = "public_val", max_tokens: int = EVAL_TOKENS,
                        timeout_seconds: float = EVAL_TIMEOUT_SECONDS, shard_path=None, shard_sha256=None,
                        local_rank: int = 0, label: str = "worker", use_sandbox: bool = True) -> dict:
    """The official evaluation: the submission's load_for_eval(checkpoint) runs in two sandboxed
    worker processes, one after the other (the second starts once the first and all it started are
    dead on every rank, and the kernel's caches are dropped), each seeing only the input rows of its
    pass; everything else happens here. Everything (the rows, both workers' start and load, the
    forwards and checks) must finish within timeout_seconds: past it, WorkerTimeout (the workers are
    gone by then)."""
    start = time.time()
    deadline = time.monotonic() + timeout_seconds
    keep_kernel_caches()  # a FRONTIER_KEEP_KERNEL_CACHES that is neither yes nor no fails now, not between the passes
    shards = scored_shards(split, shard_path, shard_sha256)
    rows, digests = evaluation_rows(tokenizer, seq_len, max_tokens, shards)
    protected = [p for p, _ in shards]  # ... and what an offline data set was built from
    protected += [] if shard_path is not None else [f for f in {source_folder(p.parent) for p in protected} if f]
    workers: list[dict] = []
    dropped: list = []  # (seconds or None, why not official): the kernel's caches, before the second worker

    def between_passes() -> None:
        dropped.append(drop_kernel_caches() if use_sandbox else (None, []))

    @contextlib.contextmanager
    def open_pass(k: int):
        seconds, reasons = dropped[-1] if k > 0 else (None, [])
        t_worker = time.time()
        with Worker("model", submission, device, deadline=deadline, label=f"{label}" if k == 0 else f"{label}.2",
                    local_rank=local_rank, tokenizer=tokenizer, protected=protected,
                    use_sandbox=use_sandbox) as worker:
            forward = ModelForward(worker, batch_size, seq_len, tokenizer.get_vocab_size())
            workers.append({"device": worker.info["device"], "sandbox": worker.sandbox_applied,
                            "start_seconds": worker.start_seconds, "sandbox_seconds": worker.sandbox_seconds,
                            "load_seconds": time.time() - t_worker, "caches_dropped_seconds": seconds,
                            "not_official_because": reasons + worker.not_official_because})
            try:
                yield forward
            finally:
                forward.close()
        workers[-1]["seconds"] = time.time() - t_worker

    result = score(open_pass, rows, tokenizer, batch_size, timeout_seconds, start, deadline, between_passes)
    if result["eval_over_timeout"]:
        raise WorkerTimeout(f"the evaluation did not finish within {timeout_seconds:g}s")
    reasons = list(dict.fromkeys(r for w in workers for r in w["not_official_because"]))
    result.update(max_tokens=max_tokens, split=split if shard_path is None else "shard",
                  shards=[str(p) for p, _ in shards], shard_sha256=digests, isolated=True,
                  device=workers[0]["device"], sandbox=workers[0]["sandbox"],
                  worker_start_seconds=workers[0]["start_seconds"], sandbox_seconds=workers[0]["sandbox_seconds"],
                  workers=workers, not_official_because=reasons, total_seconds=time.time() - start)
    return result


def causality_check(model, tokenizer: Tokenizer, batch_size: int, seq_len: int, device, max_rows: int = 32,
                    split: str = "public_val") -> dict:
    """The load contract, checked on up to max_rows real rows of public_val in this process, with
    the same secret probes as evaluate_bpb (twins at secret cuts, repeats, a replayed batch, a row
    alone). Returns `passed`, `max_abs_diff` (the worst same-shape difference, in nats of
    log-softmax), each kind's worst difference and a message. No collectives: every rank may call it."""
    if hasattr(model, "eval"):
        model.eval()
    rows, _ = evaluation_rows(tokenizer, seq_len, max_rows * seq_len, scored_shards(split))
    vocab = tokenizer.get_vocab_size()
    scorer = _Scorer(rows, get_token_bytes("cpu", tokenizer).numpy().astype(np.int64), max(1, batch_size),
                     vocab - len(SPECIAL_TOKENS), time.monotonic() + EVAL_TIMEOUT_SECONDS,
                     np.random.default_rng(secrets.randbits(128)))
    message = "ok"
    try:
        scorer.run(lambda k: _in_process(model, device, vocab))
    except EvalRefused as e:
        message = str(e)
    worst = scorer.checks.worst
    return {"passed": message == "ok", "max_abs_diff": max(worst["causality"], worst["batch_content"], worst["replay"]),
            "causal_max_abs_diff": worst["causality"], "batch_content_max_abs_diff": worst["batch_content"],
            "batch_size_max_abs_diff": worst["batch_size"], "replay_max_abs_diff": worst["replay"],
            "probes": scorer.checks.probes, "twins": scorer.checks.twins,
            "read_ahead_caught": read_ahead_caught(scorer.checks.twins),
            "tolerances": TOLERANCE_NATS, "message": message}
