"""The checks evaluate_bpb (metric) and CORE's verification (core.verify) share: log-probs computed
here, exactly for any finite logits, from the logits a model returned; absolute comparisons of them,
refused beyond a tolerance (the same for every model)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from harness.common import EvalRefused

# Absolute tolerances on log-softmax values (nats), the same for every model. "same shape": the same
# row at the same batch index of another batch of the same shape, or before a cut: the same
# computation on the same numbers, so an honest model differs by kernel nondeterminism at most.
# "batch size": the row alone instead of in a batch of B: other kernels, other rounding (bf16: a
# step of a logit, 0.0625 at 16). Not by the model's compute dtype: what the harness could observe of
# it (the logits' precision, how far two paths differ) a model controls as surely as what it says,
# so an fp32 model can always present itself as a bf16 one, and the bound on what a cheater gains is
# the bf16 tolerance's whatever it computes in.
TOLERANCE_NATS = {"same_shape": 1e-3, "batch_size": 0.1}


@dataclass
class CheckLog:
    """What the checks compared: the worst difference of each kind, and the count."""
    worst: dict = field(default_factory=lambda: {"causality": 0.0, "batch_content": 0.0, "replay": 0.0,
                                                 "batch_size": 0.0})
    probes: int = 0
    twins: int = 0  # of the probes, those cut at a position (the rest run their row whole)
    cut_positions: set = field(default_factory=set)


def checked_log_probs(logits, index, who: str = "model(inputs)", top: int = 0):
    """Log-softmax values in float64 of logits [..., V] at `index` [..., k], and, if top > 0, the `top`
    largest [..., top] and the first index of the largest [...] (torch's argmax: a tie goes to the lowest
    token id), as (lp, top_lp, argmax); else lp alone. EvalRefused unless every logit is finite.

    Exact for any finite logits: the row's maximum m is subtracted before anything is added to a
    logit, so lp = (x - m) - log(sum(exp(x - m))), where x - m is taken in float64 from the float32
    logits (exact, or off by 2^-53 of itself), and sum(exp(x - m)) lies in [1, V] (its float32 rounding
    moves lp by ~1e-6 nats at most, whatever the logits). A constant row gives -ln V exactly however large the
    constant; an offset added to a whole row changes nothing that the logits still carry; every
    log-prob is a finite number >= -(2 * 3.4e38 + ln V), so every difference the checks take and every
    sum the metric adds (float64) is finite, and a check never compares NaN with NaN."""
    x = torch.as_tensor(logits, dtype=torch.float32)  # bf16 or fp16 logits widen exactly
    lo, hi = (float(v) for v in torch.aminmax(x))
    if not (math.isfinite(lo) and math.isfinite(hi)):  # a NaN anywhere makes both NaN
        raise EvalRefused(f"{who} returned non-finite logits (NaN or inf; smallest {lo:.4g}, largest {hi:.4g}); "
                          "the harness refuses them")
    peak = x.amax(dim=-1, keepdim=True)
    log_total = (x - peak).exp_().sum(dim=-1, keepdim=True).double().log_()  # x - peak may round to -inf: exp 0

    def log_softmax_of(values: torch.Tensor) -> torch.Tensor:
        return (values.double() - peak.double()) - log_total

    lp = log_softmax_of(x.gather(-1, torch.as_tensor(index).long()))
    if not top:
        return lp
    return lp, log_softmax_of(x.topk(top, dim=-1).values), x.argmax(dim=-1)


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
