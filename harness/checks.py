"""The checks evaluate_bpb (metric) and CORE's verification (core.verify) share: log-probs
computed here in fp32 from the logits a model returned, refused unless every logit is a number
within +-LOGIT_LIMIT; absolute comparisons of them, refused beyond a tolerance; the tolerances by
the model's compute dtype."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.common import EvalRefused

# Absolute tolerances on log-softmax values (nats), by the model's compute dtype. "same shape":
# the same row in another batch of the same shape, or before a cut: the same computation on the
# same numbers, so an honest model differs by kernel nondeterminism at most. "batch size": the
# row alone instead of in a batch of B: other kernels, other rounding.
TOLERANCE_NATS = {
    "float32": {"same_shape": 1e-4, "batch_size": 1e-2},  # batch size: TF32 matmuls round like this
    "bfloat16": {"same_shape": 1e-3, "batch_size": 0.1},
    "float16": {"same_shape": 1e-3, "batch_size": 0.1},
}
LOGIT_LIMIT = 1e30  # |logit| above this is refused: below it every log-prob, difference and sum is finite


def tolerances_for(compute_dtype: str | None) -> dict:
    """The tolerance row for a compute dtype (bf16's when the model does not say)."""
    return TOLERANCE_NATS.get(compute_dtype or "bfloat16", TOLERANCE_NATS["bfloat16"])


@dataclass
class CheckLog:
    """What the checks compared: the worst difference of each kind, and the count."""
    worst: dict = field(default_factory=lambda: {"causality": 0.0, "batch_content": 0.0, "replay": 0.0,
                                                 "batch_size": 0.0})
    probes: int = 0
    twins: int = 0  # of the probes, those cut at a position (the rest run their row whole)
    cut_positions: set = field(default_factory=set)


def checked_log_probs(logits, index, who: str = "model(inputs)") -> tuple[torch.Tensor, torch.Tensor]:
    """(log-softmax at index [..., k], logsumexp [..., 1]) in fp32 from logits [..., V]. EvalRefused
    unless every logit is a number within +-LOGIT_LIMIT: then every log-prob lies in
    [-2 * LOGIT_LIMIT - ln V, 0], so every difference the checks take and every sum the metric adds
    is a finite number, and a check can never compare NaN with NaN."""
    x = torch.as_tensor(logits)
    lo, hi = (float(v) for v in torch.aminmax(x))
    if not (-LOGIT_LIMIT <= lo and hi <= LOGIT_LIMIT):  # also false for NaN
        raise EvalRefused(f"{who} returned non-finite logits (NaN or inf) or logits beyond +-{LOGIT_LIMIT:g} "
                          f"(smallest {lo:.4g}, largest {hi:.4g}); the harness refuses them")
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    lp = x.gather(-1, torch.as_tensor(index).long()) - lse
    if not bool(torch.isfinite(lp).all()):  # cannot happen within the limit; refuse rather than compare
        raise EvalRefused(f"{who} gave log-probabilities that are not finite")
    return lp, lse


CHECK_MESSAGES = {
    "causality": "log-probs before a cut point changed when the tokens after it changed (and the row ran in "
                 "another batch and another worker): the model is not causal, or its rows interact (logits at "
                 "position t must depend only on tokens 0..t of their own row)",
    "batch_content": "a row's log-probs changed when the row ran in another batch (and another worker): rows "
                     "must not interact, and the forward must be a pure function",
    "replay": "the same batch gave different log-probs in another worker: the forward must be a pure function",
    "batch_size": "a row's log-probs changed when it ran alone instead of in a batch: the output must not "
                  "depend on the batch size",
}


def compare_log_probs(kind: str, got: torch.Tensor, ref: torch.Tensor, tol: float, checks: "CheckLog",
                      what: str) -> None:
    """EvalRefused unless every |got - ref| <= tol (a NaN fails). got, ref: [T, k] log-probs; the
    message names the check, the row, the position, both values and the tolerance."""
    if not got.numel():
        return
    delta = (got - ref).abs()
    diff = float(delta.max())
    checks.worst[kind] = max(checks.worst[kind], diff)
    if not diff <= tol:
        at = int(delta.reshape(-1).argmax())
        t, j = divmod(at, got.shape[-1])
        raise EvalRefused(f"{CHECK_MESSAGES[kind]} (check {kind}: {what}, position {t}: {float(got[t, j]):.6g} vs "
                          f"{float(ref[t, j]):.6g} nats, difference {diff:.3g}, tolerance {tol:.3g})")
