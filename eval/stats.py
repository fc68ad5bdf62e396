"""Statistics for comparing runs: paired tests on per-example results, bootstrap intervals, seed summaries.

Every function takes plain python values (lists of booleans or floats, dicts) and returns plain dicts, so
results can be printed as tables or written as JSON without conversion. No plotting and no scipy.

    from eval.stats import paired_comparison
    paired_comparison(results_a["per_example"], results_b["per_example"])   # McNemar + bootstrap, Table 9 layout
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def mcnemar_exact(a_correct: Sequence[bool], b_correct: Sequence[bool]) -> dict:
    """Exact McNemar test on paired binary outcomes (the same examples scored by systems A and B).

    Counts: both_correct, a_only (A right, B wrong), b_only (A wrong, B right), neither. Only the discordant
    pairs carry information: with m = a_only + b_only and k = min(a_only, b_only), under the null hypothesis
    (A and B equally accurate) X ~ Binomial(m, 1/2), and the two-sided p-value is

        p = min(1, 2 * P[X <= k]) = min(1, 2 * sum_{i=0..k} C(m, i) / 2^m),

    with p = 1 when there are no discordant pairs (m = 0). Computed exactly in integer arithmetic.
    """
    a, b = [bool(x) for x in a_correct], [bool(x) for x in b_correct]
    if len(a) != len(b):
        raise ValueError(f"paired outcomes need equal lengths (got {len(a)} and {len(b)})")
    both = sum(x and y for x, y in zip(a, b))
    a_only = sum(x and not y for x, y in zip(a, b))
    b_only = sum(y and not x for x, y in zip(a, b))
    neither = len(a) - both - a_only - b_only
    m, k = a_only + b_only, min(a_only, b_only)
    if m == 0:
        p = 1.0
    else:
        p = min(1.0, 2 * sum(math.comb(m, i) for i in range(k + 1)) / 2**m)  # int / int: correctly rounded
    return {"n": len(a), "both_correct": both, "a_only": a_only, "b_only": b_only, "neither": neither,
            "discordant": m, "p_value": p}


def paired_bootstrap_ci(a: Sequence, b: Sequence, n_boot: int = 10000, seed: int = 0,
                        alpha: float = 0.05) -> dict:
    """Mean paired difference d = mean_i(a_i - b_i) with a percentile bootstrap confidence interval.

    a and b are per-example values for the same examples (booleans count as 0/1, or floats such as
    per-example losses). Each of n_boot replicates draws n example indices uniformly with replacement
    (numpy's default_rng(seed), so the result is a pure function of the inputs and seed) and takes the mean of
    d over them; the interval is the [alpha/2, 1 - alpha/2] percentiles of the replicate means (numpy's
    linear interpolation).

    Returns diff, ci_low, ci_high, n, n_boot, alpha, seed.
    """
    if len(a) != len(b):
        raise ValueError(f"paired values need equal lengths (got {len(a)} and {len(b)})")
    x = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    n = x.size
    if n == 0:
        raise ValueError("paired_bootstrap_ci needs at least one pair")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha}: must be in (0, 1)")
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    chunk = max(1, 4_000_000 // n)  # bounded memory: at most ~4M indices at a time
    for start in range(0, n_boot, chunk):
        rows = min(chunk, n_boot - start)
        idx = rng.integers(0, n, size=(rows, n))
        means[start:start + rows] = x[idx].mean(axis=1)
    low, high = np.percentile(means, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return {"diff": float(x.mean()), "ci_low": float(low), "ci_high": float(high), "n": n, "n_boot": n_boot,
            "alpha": alpha, "seed": seed}


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """(mean, sample standard deviation): std = sqrt(sum (x - mean)^2 / (n - 1)), ddof = 1; 0 for one value."""
    x = [float(v) for v in values]
    if not x:
        raise ValueError("mean_std needs at least one value")
    mean = sum(x) / len(x)
    if len(x) == 1:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in x) / (len(x) - 1))


def paired_comparison(per_example_a: list[dict], per_example_b: list[dict], key: str = "correct",
                      n_boot: int = 10000, seed: int = 0, alpha: float = 0.05) -> dict:
    """Compare two systems on the same examples (paper 004's Table 9 layout).

    The per_example lists (each item {"id": str, key: bool or number, ...}) are joined on "id"; the ids must
    be the same set on both sides (a ValueError names how many are missing on each side, with examples).
    Returns n, acc_a = mean(a), acc_b = mean(b), a_only / b_only (examples only A / only B gets right), the
    exact McNemar test (mcnemar_exact, on bool(value)) and the bootstrap interval of acc_a - acc_b
    (paired_bootstrap_ci). For values that are not all 0/1 (binary false; per-window losses, say) a_only /
    b_only and the test are instead on the sign of a - b: a_only counts the examples where A's value is
    lower, and the exact McNemar test on those discordant counts is the exact sign test.
    """
    def index(items, side):
        out = {}
        for i, item in enumerate(items):
            if "id" not in item or key not in item:
                raise ValueError(f"per_example {side}[{i}] lacks 'id' or '{key}': {sorted(item)}")
            ex_id = str(item["id"])
            if ex_id in out:
                raise ValueError(f"per_example {side} has the id {ex_id!r} twice")
            value = item[key]
            if isinstance(value, bool) or (isinstance(value, (int, float)) and math.isfinite(value)):
                out[ex_id] = value
            else:
                raise ValueError(f"per_example {side} id {ex_id!r}: '{key}' is {value!r}, not a boolean or number")
        return out

    a, b = index(per_example_a, "A"), index(per_example_b, "B")
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a or only_b:
        raise ValueError(
            f"per_example ids do not match: {len(only_a)} of A's {len(a)} ids are missing from B"
            f"{' (e.g. ' + ', '.join(map(repr, only_a[:3])) + ')' if only_a else ''} and {len(only_b)} of B's "
            f"{len(b)} ids are missing from A{' (e.g. ' + ', '.join(map(repr, only_b[:3])) + ')' if only_b else ''}")
    if not a:
        raise ValueError("per_example lists are empty")
    ids = sorted(a)
    va = [float(a[i]) for i in ids]
    vb = [float(b[i]) for i in ids]
    binary = all(v in (0.0, 1.0) for v in va + vb)
    if binary:
        test = mcnemar_exact([bool(v) for v in va], [bool(v) for v in vb])
    else:  # the sign test: "A only" is A lower (e.g. a lower loss), "B only" is B lower
        test = mcnemar_exact([x < y for x, y in zip(va, vb)], [y < x for x, y in zip(va, vb)])
    return {"n": len(ids), "key": key, "binary": binary, "acc_a": sum(va) / len(ids), "acc_b": sum(vb) / len(ids),
            "a_only": test["a_only"], "b_only": test["b_only"], "both_correct": test["both_correct"],
            "neither": test["neither"], "mcnemar": test,
            "bootstrap": paired_bootstrap_ci(va, vb, n_boot=n_boot, seed=seed, alpha=alpha)}


def format_p(p: float) -> str:
    """A p-value as three significant digits, or an upper bound where it is below what a double resolves (an
    exact test's tail past 1e-16 is printed as < 1e-16, never as 0)."""
    return "< 1e-16" if p < 1e-16 else f"{p:.3g}"
