"""Where a soft step sits: the threshold of ``tanh((x - t) / tau)``.

A hard split ``x > theta`` becomes ``tanh((x - t) / tau)``; the smaller ``tau``, the
closer the two, except for inputs within a few ``tau`` of ``t``. Putting ``t`` at the
framework's own ``theta`` is right for continuous data but not for ties: a value
exactly at ``theta`` reads ``tanh(0) = 0``, neither side. Ties are common in tabular
data (0/1 indicators, counts, bin indices) and the frameworks store thresholds that
hit them: LightGBM splits "zero vs. positive" at ``1e-35``, XGBoost's cut points are
data values and its rule is ``x < theta``, KBinsDiscretizer's quantile edges can be
data values and its rule is ``x >= edge``.

So each threshold is moved a little:

* with reference data (the training rows, or any sample, seen at that operator's
  input): only as far as needed to keep the nearest reference values on either side
  ``MARGIN * tau`` away (``tanh(8)`` is 1 in float32), or to the middle of their gap if
  it is narrower than that. Every reference row keeps its side, a reference value on
  the threshold reads as decided, and a threshold with no reference value near it does
  not move (sklearn's tree thresholds, midpoints of the training values, stay put when
  the reference is the training data). Unseen inputs change side only between the old
  and the new position, within ``MARGIN * tau``, and only where reference data sat that
  close;
* without: by one ``tau`` towards the side the framework sends ties to, for the
  thresholds that can coincide with data values: a tie reads ``tanh(1) = 0.76`` on the
  correct side, which a tree's leaf layer saturates again, but a bin code does not
  (a tie then counts 0.88 of a bin): pass reference rows for exact bins.
"""
from __future__ import annotations

import numpy as np

#: How far (in tau) a threshold may move towards the middle of its data gap:
#: tanh(8) = 1 - 2e-7, a decided side to float32 precision.
MARGIN = 8.0


def place(features: np.ndarray, thresholds: np.ndarray, right_on_tie: np.ndarray,
          may_tie: np.ndarray, tau: float | np.ndarray, reference: np.ndarray | None) -> np.ndarray:
    """Centres of the soft steps for splits ``(features[k], thresholds[k])``.

    ``right_on_tie[k]``: the framework sends ``x == theta`` right (its rule is
    ``x < theta`` goes left) rather than left (``x <= theta`` goes left).
    ``may_tie[k]``: the threshold can equal a data value (used without reference).
    ``reference``: rows at the operator's input, or None. ``tau``: one temperature, or
    one per threshold.
    """
    thresholds = np.asarray(thresholds, np.float64)
    tau = np.broadcast_to(np.asarray(tau, np.float64), thresholds.shape)
    fallback = np.where(may_tie, thresholds + np.where(right_on_tie, -tau, tau), thresholds)
    if reference is None:
        return fallback
    out = fallback.copy()
    ref = np.asarray(reference, np.float64)
    columns: dict[int, np.ndarray] = {}
    for k, (f, theta) in enumerate(zip(features, thresholds)):
        vals = columns.get(int(f))
        if vals is None:
            vals = columns[int(f)] = np.unique(ref[:, int(f)])
        # index of the first value that goes right
        i = np.searchsorted(vals, theta, side="left" if right_on_tie[k] else "right")
        if 0 < i < len(vals):
            lo, hi = vals[i - 1] + MARGIN * tau[k], vals[i] - MARGIN * tau[k]
            out[k] = np.clip(theta, lo, hi) if lo <= hi else 0.5 * (vals[i - 1] + vals[i])
    return out
