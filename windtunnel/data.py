"""Tabular data made here or shipped with scikit-learn: nothing is downloaded.

:func:`synthetic` draws rows whose label has a known structure, the kind classical
pipelines are built for and that joint training can still improve on: skewed and
shifted numeric columns (what scaling is for), a threshold effect (what trees find),
smooth effects (which trees only approximate in steps), categorical columns with skewed
frequencies (what one-hot encoding is for), and interactions, numeric x numeric and
categorical x numeric. The true log-odds are returned too, so the best AUC any model
can reach on a sample (the *oracle* AUC) is known.

:func:`breast_cancer` is scikit-learn's shipped copy of the Wisconsin data (569 rows,
30 numeric columns), loaded from the package's own files.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Tabular:
    """Rows ``X`` (float32: numeric columns, then categorical codes), binary labels ``y``."""
    name: str
    X: np.ndarray
    y: np.ndarray
    numeric: list[int]
    categorical: list[int]
    logit: np.ndarray | None = None       # the true log-odds (synthetic data only)

    def split(self, seed: int = 0, fractions: tuple[float, float] = (0.6, 0.2)) -> tuple["Tabular", "Tabular", "Tabular"]:
        """Train, validation and test parts (shuffled with ``seed``)."""
        idx = np.random.default_rng(seed).permutation(len(self.y))
        a = int(fractions[0] * len(idx))
        b = a + int(fractions[1] * len(idx))
        return tuple(self.take(p) for p in (idx[:a], idx[a:b], idx[b:]))

    def take(self, rows: np.ndarray) -> "Tabular":
        return Tabular(self.name, self.X[rows], self.y[rows], self.numeric, self.categorical,
                       None if self.logit is None else self.logit[rows])


#: Cardinalities of the synthetic categorical columns: g, h, i (informative), j (noise).
CARDINALITIES = (5, 20, 50, 8)


def synthetic(n: int = 20000, seed: int = 0) -> Tabular:
    """``n`` rows: numeric a-f, categorical g-j; label ~ Bernoulli(sigmoid(logit)), where

    logit = tanh(1.5 a) + (log b - 8) / 0.8 + [c > 60] - 0.6 [c < 25]
            + 0.5 (d - 50) / 10 * (+1 if g in {1, 2} else -1)
            + u[h] + v[i] * e + 0.7 a e - 0.5,

    ``b`` lognormal (scale ~3000), ``c`` uniform on 0-100, ``d`` normal(50, 10), ``f``
    and ``j`` noise, ``h`` and ``i`` with Zipf-like frequencies, ``u`` and ``v`` fixed
    random effects per category (drawn from ``seed`` too).
    """
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(n)
    b = rng.lognormal(8.0, 0.8, n)
    c = rng.uniform(0, 100, n)
    d = rng.normal(50, 10, n)
    e = rng.standard_normal(n)
    f = rng.standard_normal(n)
    cats = []
    for k, card in enumerate(CARDINALITIES):
        p = np.ones(card) if k in (0, 3) else 1.0 / np.arange(1, card + 1)
        cats.append(rng.choice(card, n, p=p / p.sum()))
    g, h, i, _j = cats
    u = rng.normal(0, 0.8, CARDINALITIES[1])
    v = rng.normal(0, 0.7, CARDINALITIES[2])
    logit = (np.tanh(1.5 * a) + (np.log(b) - 8) / 0.8 + (c > 60) - 0.6 * (c < 25)
             + 0.5 * (d - 50) / 10 * np.where(np.isin(g, (1, 2)), 1.0, -1.0)
             + u[h] + v[i] * e + 0.7 * a * e - 0.5)
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    X = np.column_stack([a, b, c, d, e, f, *cats]).astype(np.float32)
    return Tabular("synthetic", X, y, list(range(6)), list(range(6, 10)), logit)


def breast_cancer() -> Tabular:
    """scikit-learn's shipped breast cancer data (label 1: benign)."""
    from sklearn.datasets import load_breast_cancer
    d = load_breast_cancer()
    return Tabular("breast_cancer", d.data.astype(np.float32), d.target.astype(np.int64),
                   list(range(d.data.shape[1])), [])
