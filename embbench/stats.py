"""Statistics over repeats: the unit in which embbench states and compares speed.

A *repeat* is one timed window of ``run.steps`` consecutive steps after the warm-up; its median
step time is one sample. Consecutive steps are not independent (a slow phase of the machine spans
several), so they are never treated as samples of their own.

- A cell's step time is the median of its repeat medians; its throughput is the global batch over
  that same step time (one statistic, two units).
- Its interval is Student's t on the log of the repeat medians, ``exp(mean ± t·s/√n)``: step times
  are positive and their spread multiplicative, and an interval on the log scale can never leave
  the positive axis (a throughput interval of ``-2,858`` samples/s cannot happen).
- Two cells are compared by Welch's t on the log repeat medians: the ratio of their step times
  with its interval, and a p-value.

Everything here is a pure function of numbers (seconds), so the tests feed it recorded values.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

__all__ = ["LEVEL", "AucComparison", "RatioTest", "RepeatSummary", "auc_standard_error", "delong", "interval_text", "log_t_interval",
           "ratio_test", "repeat_medians", "spread_text", "summarize_repeats"]

#: The confidence level of every interval embbench prints.
LEVEL = 0.95


def _t_quantile(level: float, df: float) -> float:
    from embbench.optional import require

    t = require("scipy.stats", "the intervals over repeats (Student's t)").t
    return float(t.ppf((1 + level) / 2, df))


def repeat_medians(step_seconds: list[float], steps_per_repeat: int) -> list[float]:
    """The median step time of each repeat, from the measured steps in the order they ran."""
    if steps_per_repeat < 1 or not step_seconds or len(step_seconds) % steps_per_repeat:
        raise ValueError(f"{len(step_seconds)} step times do not make whole repeats of {steps_per_repeat} steps")
    return [statistics.median(step_seconds[i:i + steps_per_repeat])
            for i in range(0, len(step_seconds), steps_per_repeat)]


def log_t_interval(values: list[float], level: float = LEVEL) -> tuple[float, float] | None:
    """The interval of the centre of positive ``values`` (t on the log scale), or None for fewer
    than two values.

    Raises:
        MissingDependency: scipy is not installed.
    """
    if len(values) < 2:
        return None
    logs = [math.log(v) for v in values]
    half = _t_quantile(level, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    centre = statistics.fmean(logs)
    return math.exp(centre - half), math.exp(centre + half)


@dataclass(frozen=True)
class RepeatSummary:
    """A cell's speed over its repeats."""

    repeat_medians_s: list[float]
    #: median of the repeat medians: the cell's step time
    step_s: float
    #: the step time's interval (None: one repeat)
    step_interval_s: tuple[float, float] | None

    @property
    def noise(self) -> float | None:
        """The interval's half-width relative to the step time (the larger side): ``0.05`` is ±5 %."""
        if self.step_interval_s is None:
            return None
        low, high = self.step_interval_s
        return max(high / self.step_s - 1, 1 - low / self.step_s)

    def throughput(self, samples_per_step: int) -> tuple[float, tuple[float, float] | None]:
        """Samples per second and its interval, from the same statistic as :attr:`step_s`."""
        interval = None
        if self.step_interval_s is not None:
            interval = (samples_per_step / self.step_interval_s[1], samples_per_step / self.step_interval_s[0])
        return samples_per_step / self.step_s, interval


def interval_text(interval: tuple[float, float], digits: int = 1) -> str:
    """A ratio's interval as relative changes, ``[-12.0%, +4.1%]``; one reaching beyond +100 % as
    ratios, ``[x0.03..x3.5]`` (not ``[-97.0%, +250.0%]``: past a doubling, percentages read badly)."""
    low, high = interval
    if high > 2:
        return f"[x{low:.3g}..x{high:.3g}]"
    return f"[{100 * (low - 1):+.{digits}f}%, {100 * (high - 1):+.{digits}f}%]"


def spread_text(noise: float, digits: int = 1) -> str:
    """A relative half-width (:attr:`RepeatSummary.noise`): ``±5.0%``, and beyond ±100 % the ratio
    its interval reaches, ``up to x36``."""
    return f"±{100 * noise:.{digits}f}%" if noise <= 1 else f"up to x{1 + noise:.2g}"


def summarize_repeats(medians: list[float], level: float = LEVEL) -> RepeatSummary:
    """:class:`RepeatSummary` of a cell's repeat medians (seconds)."""
    return RepeatSummary(list(medians), statistics.median(medians), log_t_interval(medians, level))


@dataclass(frozen=True)
class RatioTest:
    """``after`` against ``before``: the ratio of their throughputs (``> 1``: after is faster)."""

    #: throughput after / before, from the medians of the repeat medians
    ratio: float
    #: its interval (Welch's t on the log repeat medians); None: a side has one repeat
    interval: tuple[float, float] | None
    p_value: float | None
    n_before: int
    n_after: int


def ratio_test(before: list[float], after: list[float], level: float = LEVEL) -> RatioTest:
    """Welch's t test of two cells' repeat medians (step seconds) on the log scale.

    Raises:
        MissingDependency: scipy is not installed.
    """
    ratio = statistics.median(before) / statistics.median(after)
    if len(before) < 2 or len(after) < 2:
        return RatioTest(ratio, None, None, len(before), len(after))
    from embbench.optional import require

    t = require("scipy.stats", "the comparison of repeats (Welch's t)").t
    a, b = [math.log(v) for v in before], [math.log(v) for v in after]
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff = statistics.fmean(a) - statistics.fmean(b)  # log(throughput after / before)
    se = math.sqrt(va + vb)
    if se == 0:  # identical repeats on both sides: no spread to test against
        return RatioTest(ratio, (math.exp(diff), math.exp(diff)), 0.0 if diff else 1.0, len(a), len(b))
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))  # Welch-Satterthwaite
    half = float(t.ppf((1 + level) / 2, df)) * se
    p = float(2 * t.sf(abs(diff) / se, df))
    return RatioTest(ratio, (math.exp(diff - half), math.exp(diff + half)), p, len(a), len(b))


# --- accuracy: AUCs on the same evaluation samples ------------------------------------------------


def _delong_components(labels, scores):
    """DeLong's structural components of each model's AUC (Sun & Xu's midrank form): the AUCs,
    and per positive (``v10``) and per negative (``v01``) sample each model's share of them."""
    import numpy as np

    from embbench.optional import require

    rankdata = require("scipy.stats", "the standard error of an AUC (DeLong)").rankdata
    labels = np.asarray(labels).astype(bool)
    scores = np.atleast_2d(np.asarray(scores, dtype=np.float64))
    pos, neg = scores[:, labels], scores[:, ~labels]
    m, n = pos.shape[1], neg.shape[1]
    if m == 0 or n == 0:
        raise ValueError("an AUC needs evaluation samples of both labels")
    both = rankdata(np.concatenate([pos, neg], axis=1), axis=1)
    within_pos, within_neg = rankdata(pos, axis=1), rankdata(neg, axis=1)
    aucs = (both[:, :m].sum(axis=1) - m * (m + 1) / 2) / (m * n)
    v10 = (both[:, :m] - within_pos) / n
    v01 = 1 - (both[:, m:] - within_neg) / m
    return aucs, v10, v01


def auc_standard_error(labels, scores) -> float:
    """The standard error of one AUC over its evaluation samples (DeLong's variance); NaN
    where a label occurs once (no variance to estimate)."""
    import numpy as np

    _, v10, v01 = _delong_components(labels, scores)
    if min(v10.shape[1], v01.shape[1]) < 2:
        return math.nan
    return float(np.sqrt(v10.var(ddof=1) / v10.shape[1] + v01.var(ddof=1) / v01.shape[1]))


@dataclass(frozen=True)
class AucComparison:
    """Two models' AUCs on the same samples: ``b - a`` with its standard error and p-value."""

    auc_a: float
    auc_b: float
    standard_error: float
    p_value: float
    #: the samples' covariance taken out (DeLong); False: two standard errors, unpaired
    paired: bool = False
    #: the evaluation samples (None: not known)
    samples: int | None = None

    @property
    def difference(self) -> float:
        return self.auc_b - self.auc_a


def delong(labels, scores_a, scores_b) -> AucComparison:
    """DeLong's test of two AUCs on the same evaluation samples (paired: their covariance over
    the samples taken out), two-sided.

    Raises:
        MissingDependency: scipy is not installed.
    """
    import numpy as np

    from embbench.optional import require

    norm = require("scipy.stats", "the comparison of AUCs (DeLong's test)").norm
    aucs, v10, v01 = _delong_components(labels, np.stack([scores_a, scores_b]))
    cov = np.cov(v10) / v10.shape[1] + np.cov(v01) / v01.shape[1]
    se = float(np.sqrt(max(cov[0, 0] + cov[1, 1] - 2 * cov[0, 1], 0.0)))
    diff = float(aucs[1] - aucs[0])
    p = (0.0 if diff else 1.0) if se == 0 else float(2 * norm.sf(abs(diff) / se))
    return AucComparison(float(aucs[0]), float(aucs[1]), se, p, paired=True, samples=len(labels))
