"""Least squares with non-negative coefficients, shared by the planner's calibration
(tools/plan/calibrate.py) and the push cost model (push_model.py): every fitted cost is a time, a
time per item or a time per byte, so a negative one would be a fit of noise, not of the machine.

Example:
    X = np.array([[1.0, 10.0], [1.0, 20.0], [1.0, 40.0]])
    nnls(X, X @ np.array([0.5, 0.01]))          # array([0.5, 0.01])
"""

from __future__ import annotations

import numpy as np

__all__ = ["nnls"]


def nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (active set: drop the negative ones, refit)."""
    free = list(range(X.shape[1]))
    while True:
        coef = np.zeros(X.shape[1])
        coef[free] = np.linalg.lstsq(X[:, free], y, rcond=None)[0]
        neg = [i for i in free if coef[i] < 0]
        if not neg:
            return coef
        free.remove(min(neg, key=lambda i: coef[i]))
