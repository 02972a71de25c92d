"""Train–inference consistency of a step, from what the step computes anyway.

For every loss token, d = log p_trainer(token) - log p_behaviour(token): the trainer's logprob
under the weights its minibatch starts from, and the one rollout recorded when it sampled the
token. d is the log importance ratio every off-policy correction reads (r = exp(d)). It is 0
where the engine and the trainer compute the same policy on the same weights; kernels,
precision and staleness move it.

Per step (`StepRecord`):

    log_ratio_mean      mean of d over the loss tokens
    log_ratio_abs_mean  mean of |d|
    log_ratio_p99       99th percentile of |d| (the upper edge of its bin in ABS_EDGES)
    log_ratio_max       the largest |d|
    behaviour_kl        k3 estimate of KL(behaviour || trainer) from the behaviour's own
                        samples: the mean of r - 1 - d (non-negative, 0 when they agree)
    ratio_histogram     loss tokens per bin of d (`treadle_common.api.runs.RATIO_EDGES`):
                        bin i holds RATIO_EDGES[i-1] <= d < RATIO_EDGES[i]
    staleness_histogram trajectories trained per staleness (index = versions behind)
    drift_by_staleness  mean |d| of the loss tokens of each staleness (index = versions
                        behind, the last bucket holding STALE_BUCKETS - 1 and more): how
                        much of the drift is the engine (0 behind) and how much is age

`Drift` sums a (mini)batch's tokens; the sums add across micro-batches and ranks (the
maximum is taken); `merge` joins the minibatches of one step.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from treadle_common.api.runs import RATIO_EDGES

ABS_EDGES = tuple(10.0 ** (k / 4) for k in range(-24, 5))
"""Bin edges of |d| for its percentiles: 1e-6 to 10, four a decade."""
_SCALARS = 4  # token count, sum of d, sum of |d|, sum of k3
STALE_BUCKETS = 8
"""Staleness buckets of `drift_by_staleness`: 0 .. 6 versions behind, and 7 or more."""
Reduce = Callable[[torch.Tensor], torch.Tensor]


class Drift:
    """A batch's log ratios as sums: its token count, the sums of d, |d| and k3, the
    histograms of d and |d|, and the largest |d|."""

    def __init__(self) -> None:
        self.sums = torch.zeros(
            _SCALARS + len(RATIO_EDGES) + 1 + len(ABS_EDGES) + 1 + 2 * STALE_BUCKETS,
            dtype=torch.float64,
        )
        self.max = torch.zeros((), dtype=torch.float64)
        self._edges = torch.tensor(RATIO_EDGES, dtype=torch.float64)
        self._abs_edges = torch.tensor(ABS_EDGES, dtype=torch.float64)

    @torch.no_grad()
    def add(
        self,
        logprobs: torch.Tensor,
        behaviour: torch.Tensor,
        weight: torch.Tensor,
        staleness_B: torch.Tensor | None = None,
    ) -> None:
        """The loss tokens (`weight > 0`) of one micro-batch ([B, T] each; `staleness_B`,
        [B]: each sequence's versions behind, 0 when not given)."""
        live = weight.cpu() > 0
        d = (logprobs.detach() - behaviour).double().cpu()[live]
        if not d.numel():
            return
        a = d.abs()
        stale = torch.zeros_like(weight, dtype=torch.long).cpu()
        if staleness_B is not None:
            stale = staleness_B.cpu().long()[:, None].expand_as(stale)
        bucket = stale[live].clamp(0, STALE_BUCKETS - 1)
        k3 = torch.expm1(d) - d
        bins = torch.bucketize(d, self._edges, right=True)
        abs_bins = torch.bucketize(a, self._abs_edges, right=True)
        self.sums += torch.cat(
            [
                torch.stack(
                    [
                        torch.tensor(float(d.numel()), dtype=torch.float64),
                        d.sum(),
                        a.sum(),
                        k3.sum(),
                    ]
                ),
                torch.bincount(bins, minlength=len(RATIO_EDGES) + 1).double(),
                torch.bincount(abs_bins, minlength=len(ABS_EDGES) + 1).double(),
                torch.bincount(bucket, minlength=STALE_BUCKETS).double(),
                torch.bincount(bucket, weights=a, minlength=STALE_BUCKETS).double(),
            ]
        )
        self.max = torch.maximum(self.max, a.max())

    def summary(self, total: Reduce, maximum: Reduce) -> dict[str, Any]:
        """The step's figures (the table above), after `total` (a sum across ranks) of the
        sums and `maximum` of the largest |d|."""
        sums = total(self.sums).tolist()
        largest = float(maximum(self.max))
        n, sum_d, sum_abs, sum_k3 = sums[:_SCALARS]
        end = _SCALARS + len(RATIO_EDGES) + 1
        hist = [int(c) for c in sums[_SCALARS:end]]
        abs_hist = [int(c) for c in sums[end : end + len(ABS_EDGES) + 1]]
        stale_tokens = sums[end + len(ABS_EDGES) + 1 :][:STALE_BUCKETS]
        stale_abs = sums[end + len(ABS_EDGES) + 1 + STALE_BUCKETS :]
        if not n:
            return {}
        return {
            "log_ratio_mean": sum_d / n,
            "log_ratio_abs_mean": sum_abs / n,
            "log_ratio_p99": percentile(abs_hist, 0.99, largest),
            "log_ratio_max": largest,
            "behaviour_kl": sum_k3 / n,
            "ratio_histogram": hist,
            "drift_by_staleness": by_staleness(stale_tokens, stale_abs),
            "_abs_histogram": abs_hist,  # for `merge`; not step fields
            "_stale_tokens": stale_tokens,
            "_stale_abs": stale_abs,
        }


def by_staleness(tokens: Sequence[float], abs_sums: Sequence[float]) -> list[float]:
    """Mean |d| per staleness bucket, up to the last one holding tokens (0.0 for an empty
    one below it)."""
    live = [i for i, n in enumerate(tokens) if n]
    if not live:
        return []
    return [abs_sums[i] / tokens[i] if tokens[i] else 0.0 for i in range(live[-1] + 1)]


def percentile(abs_hist: Sequence[int], q: float, largest: float) -> float:
    """The upper edge of the |d| bin holding the q-quantile (at most the largest |d|)."""
    total = sum(abs_hist)
    if not total:
        return 0.0
    seen = 0
    for i, count in enumerate(abs_hist):
        seen += count
        if seen >= q * total:
            return min(ABS_EDGES[i], largest) if i < len(ABS_EDGES) else largest
    return largest


def merge(outs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One step's figures from its minibatches' (each weighted by its tokens)."""
    parts = [o for o in outs if "ratio_histogram" in o]
    if not parts:
        return {}
    tokens = [float(sum(o["ratio_histogram"])) for o in parts]
    n = sum(tokens) or 1.0
    hist = [sum(col) for col in zip(*(o["ratio_histogram"] for o in parts), strict=True)]
    abs_hist = [sum(col) for col in zip(*(o["_abs_histogram"] for o in parts), strict=True)]
    stale_tokens = [sum(c) for c in zip(*(o["_stale_tokens"] for o in parts), strict=True)]
    stale_abs = [sum(c) for c in zip(*(o["_stale_abs"] for o in parts), strict=True)]
    largest = max(o["log_ratio_max"] for o in parts)
    mean = {
        k: sum(o[k] * w for o, w in zip(parts, tokens, strict=True)) / n
        for k in ("log_ratio_mean", "log_ratio_abs_mean", "behaviour_kl")
    }
    return {
        **mean,
        "log_ratio_p99": percentile(abs_hist, 0.99, largest),
        "log_ratio_max": largest,
        "ratio_histogram": hist,
        "drift_by_staleness": by_staleness(stale_tokens, stale_abs),
    }


def staleness_histogram(stale: Sequence[int]) -> list[int]:
    """Trajectories per staleness (index = versions behind the trainer)."""
    counts = [0] * (max(stale, default=-1) + 1)
    for s in stale:
        counts[s] += 1
    return counts


def ratio_bin(d: float) -> int:
    """The `ratio_histogram` bin of log ratio `d`."""
    return bisect.bisect_right(RATIO_EDGES, d)
