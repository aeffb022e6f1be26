"""Pipeline translation (paper §5.2): walk a fitted pipeline, translate each operator,
compose the results the way the pipeline composes its steps.

``translate(model)`` accepts a fitted scikit-learn ``Pipeline`` (possibly holding
``ColumnTransformer`` s, themselves holding pipelines), a bare fitted estimator, or a
LightGBM/XGBoost booster. The mapping table:

| operator | block |
|---|---|
| ``Pipeline`` | :class:`~.network.Chain` |
| ``ColumnTransformer`` | :class:`~.network.Columns` (``passthrough``/``drop`` remainder too) |
| ``StandardScaler`` | :class:`~.featurizers.Affine` |
| ``OneHotEncoder`` | :class:`~.featurizers.OneHotEmbedding` |
| ``KBinsDiscretizer`` | :class:`~.featurizers.SoftBins` |
| ``LinearRegression``, ``Ridge``, ``Lasso``, ``ElasticNet``, ``LogisticRegression`` | :class:`~.linear.Linear` |
| ``GradientBoostingClassifier``/``Regressor``, LightGBM, XGBoost | :class:`~.trees.SoftTrees` |

Anything else raises :class:`~.errors.WindTunnelError` naming the operator and where it
sits. ``reference`` rows (e.g. the training data) are pushed through the pipeline's own
transforms so that each soft step can be centred in the gap of the data it sees
(``thresholds.py``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .errors import WindTunnelError
from .featurizers import from_kbins, from_one_hot, from_standard_scaler
from .linear import from_linear_model
from .network import Block, Chain, Columns, WindTunnelNet
from .trees import SoftTrees, from_lightgbm, from_sklearn_gb, from_xgboost

#: Default temperature of the soft splits and steps: the paper's, which fine-tuning
#: needs (steeper splits pass no gradient). Pass tau=1e-3 or less for a network that
#: takes the pipeline's decisions (docs/windtunnel.md, "tau").
DEFAULT_TAU = 1.0

SUPPORTED = ("Pipeline, ColumnTransformer, StandardScaler, OneHotEncoder, KBinsDiscretizer, LinearRegression, "
             "Ridge, Lasso, ElasticNet, LogisticRegression, GradientBoostingClassifier/Regressor, "
             "LightGBM and XGBoost (gbtree) models")


def translate(model: Any, *, tau: float = DEFAULT_TAU, reference: np.ndarray | None = None,
              level: int = 4) -> WindTunnelNet:
    """The differentiable network of a fitted pipeline, estimator or booster.

    ``tau``: temperature of every soft split and bin edge (smaller = closer to the hard
    decisions, flatter gradients). ``reference``: rows at the pipeline's input used to
    centre thresholds in the data's gaps (recommended: the training rows).
    ``level``: the GBDT parametrization level, 1-4 (trees.py).
    """
    ctx = _Context(tau, level)
    ref = None if reference is None else np.asarray(reference, np.float32)
    steps = _steps(model)
    blocks: list[Block] = []
    for path, est in steps[:-1]:
        block = ctx.transform(est, path, ref)
        if block is not None:
            blocks.append(block)
            ref = None if ref is None else _dense(est.transform(ref))
    path, last = steps[-1]
    if _library(last) == "xgboost" and any(_gives_sparse(e) for _, e in steps[-2:-1]):
        raise WindTunnelError(
            f"{type(last).__name__} ({path}) reads the sparse matrix of {_describe(steps[-2][1])}, and XGBoost "
            "takes the zeros of a sparse matrix for missing values, which a network cannot tell from zeros: "
            "make that step's output dense (ColumnTransformer(sparse_threshold=0), "
            "OneHotEncoder(sparse_output=False), KBinsDiscretizer(encode='onehot-dense')) and refit")
    head, link, classes = ctx.model(last, path, ref)
    body = Chain(blocks + [head]) if blocks else head
    return WindTunnelNet(body, link, classes, source=_describe(model))


def _steps(model: Any) -> list[tuple[str, Any]]:
    """(path, estimator) of the top-level steps, ``passthrough`` ones left out."""
    if _is(model, "Pipeline"):
        steps = [(f"step {name!r}", est) for name, est in model.steps if est not in (None, "passthrough")]
        if not steps:
            raise WindTunnelError("the pipeline has no steps to translate")
        return steps
    return [("model", model)]


def _is(est: Any, *names: str) -> bool:
    return type(est).__name__ in names and type(est).__module__.startswith("sklearn")


def _library(est: Any) -> str:
    return type(est).__module__.split(".")[0]


def _gives_sparse(est: Any) -> bool:
    """Whether a fitted transform's output is a scipy sparse matrix."""
    if _is(est, "ColumnTransformer"):
        return bool(getattr(est, "sparse_output_", False))
    if _is(est, "OneHotEncoder"):
        return bool(est.sparse_output)
    if _is(est, "KBinsDiscretizer"):
        return est.encode == "onehot"
    if _is(est, "Pipeline"):
        steps = [e for _, e in est.steps if e not in (None, "passthrough")]
        return bool(steps) and _gives_sparse(steps[-1])
    return False


def _dense(a: Any) -> np.ndarray:
    return np.asarray(a.toarray() if hasattr(a, "toarray") else a, np.float32)


def _describe(model: Any) -> str:
    if _is(model, "Pipeline"):
        return " -> ".join(_describe(e) for _, e in model.steps if e not in (None, "passthrough"))
    if _is(model, "ColumnTransformer"):
        return "ColumnTransformer(" + ", ".join(_describe(t) if not isinstance(t, str) else t
                                                for _, t, _ in model.transformers_) + ")"
    return type(model).__name__


class _Context:
    def __init__(self, tau: float, level: int):
        if not tau > 0:
            raise WindTunnelError(f"tau must be positive, got {tau}")
        self.tau, self.level = tau, level

    def unsupported(self, est: Any, path: str) -> WindTunnelError:
        return WindTunnelError(f"WindTunnel cannot translate {type(est).__name__} ({path}); "
                               f"supported: {SUPPORTED}")

    def transform(self, est: Any, path: str, ref: np.ndarray | None) -> Block | None:
        """The block of a data transform (None for ``passthrough``)."""
        if isinstance(est, str) and est == "passthrough":
            return None
        if _is(est, "FunctionTransformer") and est.func is None:
            return None   # the identity (what a fitted ColumnTransformer makes of "passthrough")
        if _is(est, "StandardScaler"):
            return from_standard_scaler(est)
        if _is(est, "OneHotEncoder"):
            return from_one_hot(est)
        if _is(est, "KBinsDiscretizer"):
            return from_kbins(est, self.tau, ref)
        if _is(est, "Pipeline"):
            blocks = []
            for name, step in est.steps:
                if step in (None, "passthrough"):
                    continue
                b = self.transform(step, f"{path} / step {name!r}", ref)
                if b is not None:
                    blocks.append(b)
                    ref = None if ref is None else _dense(step.transform(ref))
            return Chain(blocks) if blocks else None
        if _is(est, "ColumnTransformer"):
            return self.columns(est, path, ref)
        raise self.unsupported(est, path)

    def columns(self, ct: Any, path: str, ref: np.ndarray | None) -> Columns:
        if ct.transformer_weights:
            raise WindTunnelError(f"ColumnTransformer with transformer_weights ({path}) is not supported")
        branches = []
        for name, trans, _ in ct.transformers_:
            cols = list(ct._transformer_to_input_indices.get(name, []))
            if isinstance(trans, str) and trans == "drop" or not cols:
                continue
            sub = None if ref is None else ref[:, cols]
            block = self.transform(trans, f"{path} / transformer {name!r}", sub)
            if block is not None and block.in_dim != len(cols):
                raise WindTunnelError(f"{path} / {name!r}: {len(cols)} columns in, block expects {block.in_dim}")
            branches.append((cols, block))
        if not branches:
            raise WindTunnelError(f"ColumnTransformer ({path}) drops every column")
        return Columns(ct.n_features_in_, branches)

    def model(self, est: Any, path: str, ref: np.ndarray | None) -> tuple[Block, str, np.ndarray | None]:
        """(block, link, classes) of the final estimator."""
        if _is(est, "LinearRegression", "Ridge", "Lasso", "ElasticNet", "LogisticRegression"):
            return from_linear_model(est)
        if _is(est, "GradientBoostingClassifier", "GradientBoostingRegressor"):
            ens = from_sklearn_gb(est)
        elif _library(est) == "lightgbm" and type(est).__name__ in ("Booster", "LGBMClassifier", "LGBMRegressor"):
            ens = from_lightgbm(est)
        elif _library(est) == "xgboost" and type(est).__name__ in ("Booster", "XGBClassifier", "XGBRegressor"):
            ens = from_xgboost(est)
        else:
            if hasattr(est, "transform") and not hasattr(est, "predict"):
                raise WindTunnelError(f"the pipeline ends in {type(est).__name__} ({path}), a transform: "
                                      "WindTunnel translates pipelines that end in a model")
            raise self.unsupported(est, path)
        return SoftTrees(ens, self.tau, ref, self.level), ens.link, ens.classes
