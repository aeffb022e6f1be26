"""Translated gradient-boosted trees (paper §5.2.2): each tree becomes a two-layer MLP.

For an internal node ``n`` testing feature ``i(n)`` against ``theta_n`` the first layer
has a unit ``n~(x) = tanh((x_i(n) - theta_n) / tau)``: near +1 when the framework goes
right (``x > theta``), near -1 when it goes left. For a leaf ``l`` whose path from the
root takes ``C_l`` decisions the second layer has a unit

    l~(x) = tanh((sum_k s_k * n~_k(x) - C_l + 1) / tau),

``s_k = +1`` where the path goes right at ancestor ``k`` and -1 where it goes left: the
sum reaches ``C_l`` exactly when every decision on the path holds, so the argument is
``+1/tau`` for the one leaf the input reaches and at most ``-1/tau`` for every other
(the maximum-margin hyperplane of the conjunction). The tree's output is
``sum_l (nu_l / 2) * (1 + l~(x))``: the reached leaf's value ``nu_l``, up to the smoothing.
A boosted ensemble sums its trees (learning rate folded into the leaf values) plus its
base score, per output column (one per class for multiclass).

All trees are one :class:`SoftTrees` block, batched as the paper does it: the first
layer is one matrix over every tree's nodes, the second a batched matrix product with
one ``(nodes x leaves)`` block per tree, padded to the largest tree (masks keep the
padding at zero through training).

Parametrization levels (which parameters fine-tuning may change), as in the paper:
L1 leaf values and output bias; L2 also the thresholds (first-layer biases); L3 also
the first-layer weights (a node may test a linear combination of features); L4 also
the second layer, weights and biases, inside each tree's block (the decision
structure itself). The default is L4, the paper's.

Sources: scikit-learn's ``GradientBoostingClassifier``/``Regressor``, LightGBM (a
``Booster`` or its scikit-learn wrappers) and XGBoost (``gbtree`` boosters and
wrappers). Each converter produces a :class:`TreeEnsemble`, a framework-neutral record
that also evaluates the hard trees exactly (for the base score and the tests).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
import numpy as np
import torch
import torch.nn.functional as F

from .errors import WindTunnelError
from .network import Block, OnnxBuilder, param, uniform_
from .thresholds import place

LEVELS = (1, 2, 3, 4)


@dataclass
class Tree:
    """One hard tree: internal nodes ``0..n-1`` and leaves with their paths."""
    feature: list[int] = field(default_factory=list)
    threshold: list[float] = field(default_factory=list)
    may_tie: list[bool] = field(default_factory=list)        # threshold can equal a data value
    leaf_value: list[float] = field(default_factory=list)
    leaf_path: list[list[tuple[int, int]]] = field(default_factory=list)  # (node, +1 right / -1 left)
    output: int = 0                                          # output column (class) it adds to


@dataclass
class TreeEnsemble:
    """Trees that add up to raw scores: ``raw = base + sum of each tree's leaf value``.

    ``right_on_tie``: the framework's rule is ``x < theta`` goes left (XGBoost), so a
    value equal to the threshold goes right; otherwise ``x <= theta`` goes left.
    """
    n_features: int
    n_outputs: int
    trees: list[Tree]
    base: np.ndarray
    right_on_tie: bool = False
    link: str = "identity"
    classes: np.ndarray | None = None
    source: str = ""

    def raw(self, X: np.ndarray) -> np.ndarray:
        """The hard trees' raw scores for rows ``X`` (the framework's own decisions)."""
        X = np.asarray(X, np.float32)
        out = np.tile(np.asarray(self.base, np.float64), (len(X), 1))
        for t in self.trees:
            col = X[:, t.feature].astype(np.float64)
            thr = np.asarray(t.threshold, np.float64)
            right = (col >= thr) if self.right_on_tie else (col > thr)
            for v, path in zip(t.leaf_value, t.leaf_path):
                hit = np.ones(len(X), bool)
                for n, s in path:
                    hit &= right[:, n] if s > 0 else ~right[:, n]
                out[:, t.output] += v * hit
        return out


class SoftTrees(Block):
    """The batched soft trees of a :class:`TreeEnsemble` (see the module docstring)."""

    def __init__(self, ens: TreeEnsemble, tau: float, reference: np.ndarray | None = None, level: int = 4):
        trees = [t for t in ens.trees if t.feature]
        if not trees:
            raise WindTunnelError(f"{ens.source}: every tree is a single leaf; nothing to translate")
        if level not in LEVELS:
            raise WindTunnelError(f"parametrization level {level} is not one of {LEVELS}")
        if tau <= 0:
            raise WindTunnelError(f"tau must be positive, got {tau}")
        super().__init__(ens.n_features, ens.n_outputs)
        self.tau, self.level = tau, level
        T, N, L, K = len(trees), max(len(t.feature) for t in trees), max(len(t.leaf_value) for t in trees), ens.n_outputs
        self.shape = (T, N, L)
        w1 = np.zeros((ens.n_features, T * N))
        b1 = np.zeros(T * N)
        m1 = np.zeros(T * N)
        w2 = np.zeros((T, N, L))
        b2 = np.full((T, L), -1.0 / tau)
        m2 = np.zeros((T, N, L))
        v = np.zeros((T, L))
        mv = np.zeros((T, L))
        assign = np.zeros((T, K))
        base = np.asarray(ens.base, np.float64).copy()
        # single-leaf trees are constants: fold them into the base
        for t in ens.trees:
            if not t.feature:
                base[t.output] += t.leaf_value[0]
        feats = np.concatenate([t.feature for t in trees])
        centres = place(feats, np.concatenate([t.threshold for t in trees]),
                        np.full(len(feats), ens.right_on_tie), np.concatenate([t.may_tie for t in trees]),
                        tau, reference)
        k = 0
        for ti, t in enumerate(trees):
            n = len(t.feature)
            cols = ti * N + np.arange(n)
            w1[t.feature, cols] = 1.0 / tau
            b1[cols] = -centres[k:k + n] / tau
            m1[cols] = 1.0
            k += n
            m2[ti, :n, :len(t.leaf_value)] = 1.0
            for li, (val, path) in enumerate(zip(t.leaf_value, t.leaf_path)):
                for node, s in path:
                    w2[ti, node, li] = s / tau
                b2[ti, li] = (1.0 - len(path)) / tau
                v[ti, li] = val / 2.0
                mv[ti, li] = 1.0
                base[t.output] += val / 2.0
            assign[ti, t.output] = 1.0
        self.w1, self.b1 = param(w1), param(b1)
        self.w2, self.b2 = param(w2), param(b2)
        self.v, self.c = param(v), param(base)
        for name, m in (("m1", m1), ("m2", m2), ("mv", mv), ("assign", assign)):
            self.register_buffer(name, torch.as_tensor(m, dtype=torch.float32))
        self.set_level(level)

    def set_level(self, level: int) -> None:
        """Declare the parameters of ``level`` (1-4) trainable and freeze the others."""
        self.level = level
        for p, lv in ((self.v, 1), (self.c, 1), (self.b1, 2), (self.w1, 3), (self.w2, 4), (self.b2, 4)):
            p.requires_grad_(level >= lv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, N, L = self.shape
        h1 = torch.tanh(x @ (self.w1 * self.m1) + self.b1 * self.m1)
        h1 = F.dropout(h1, self.dropout, self.training)
        h1 = h1.view(-1, T, N).transpose(0, 1)                              # (T, B, N)
        h2 = torch.tanh(torch.baddbmm(self.b2.unsqueeze(1), h1, self.w2 * self.m2))  # (T, B, L)
        h2 = F.dropout(h2, self.dropout, self.training)
        return torch.einsum("tbl,tl,tk->bk", h2, self.v * self.mv, self.assign) + self.c

    def to_onnx(self, g: OnnxBuilder, x: str) -> str:
        T, N, L = self.shape
        h1 = g.op("Tanh", [g.op("Add", [g.op("MatMul", [x, g.weight(self.w1 * self.m1, "split_w")]),
                                        g.weight(self.b1 * self.m1, "split_b")])])
        h1 = g.op("Transpose", [g.op("Reshape", [h1, g.const(np.int64([-1, T, N]), "shape")])], perm=[1, 0, 2])
        z2 = g.op("Add", [g.op("MatMul", [h1, g.weight(self.w2 * self.m2, "leaf_w")]),
                          g.weight(self.b2.unsqueeze(1), "leaf_b")])
        h2 = g.op("Tanh", [z2])                                                  # (T, B, L)
        # per tree (T, B, L) x (T, L, K), then the sum over trees: one (B, T*L) x (T*L, K)
        # product instead is a GEMV whose DLight schedule needs more shared memory than
        # sm_75 has at batch 256 and 100 trees (ptxas: "uses too much shared data")
        out_w = (self.v * self.mv).unsqueeze(2) * self.assign.unsqueeze(1)      # (T, L, K)
        per_tree = g.op("MatMul", [h2, g.weight(out_w, "leaf_values")])          # (T, B, K)
        total = g.op("ReduceSum", [per_tree, g.const(np.int64([0]), "axis")], keepdims=0)
        return g.op("Add", [total, g.weight(self.c, "base")])

    def cold_init(self, gen: torch.Generator) -> None:
        T, N, L = self.shape
        for p, fan_in in ((self.w1, self.in_dim), (self.b1, self.in_dim), (self.w2, N), (self.b2, N),
                          (self.v, L), (self.c, T * L)):
            uniform_(p, fan_in, gen)


# ======================================================================================
# Converters: a fitted model -> TreeEnsemble
# ======================================================================================
def _walk(node, is_leaf, split, children, tree: Tree, path: list[tuple[int, int]]) -> None:
    """Depth-first over one framework's node records (dicts; a leaf's value under
    ``"value"``, which each converter sets), numbering internal nodes."""
    if is_leaf(node):
        tree.leaf_value.append(float(node["value"]))
        tree.leaf_path.append(list(path))
        return
    feature, threshold, may_tie = split(node)
    k = len(tree.feature)
    tree.feature.append(int(feature))
    tree.threshold.append(float(threshold))
    tree.may_tie.append(bool(may_tie))
    left, right = children(node)
    _walk(left, is_leaf, split, children, tree, path + [(k, -1)])
    _walk(right, is_leaf, split, children, tree, path + [(k, +1)])


def _sklearn_tree(t, scale: float, output: int) -> Tree:
    tr = Tree(output=output)
    nodes = [{"id": i, "value": scale * t.value[i].ravel()[0]} for i in range(t.node_count)]
    _walk(nodes[0], lambda n: t.children_left[n["id"]] == -1,
          # sklearn's thresholds are midpoints between training values: no ties there
          lambda n: (t.feature[n["id"]], t.threshold[n["id"]], False),
          lambda n: (nodes[t.children_left[n["id"]]], nodes[t.children_right[n["id"]]]), tr, [])
    return tr


def from_sklearn_gb(est) -> TreeEnsemble:
    """``GradientBoostingClassifier`` / ``GradientBoostingRegressor``."""
    name = type(est).__name__
    if getattr(est, "loss", "") == "exponential":
        raise WindTunnelError(f"{name}(loss='exponential') is not supported: use loss='log_loss'")
    init = est.init_
    if not (isinstance(init, str) and init == "zero") and not type(init).__name__.startswith("Dummy"):
        raise WindTunnelError(f"{name} with init={type(init).__name__}: only the default (constant) or 'zero' "
                              "initial estimator can be translated")
    d = est.n_features_in_
    base = est._raw_predict_init(np.zeros((1, d), np.float32))[0]
    n_est, K = est.estimators_.shape
    trees = [_sklearn_tree(est.estimators_[i, k].tree_, est.learning_rate, k)
             for i in range(n_est) for k in range(K)]
    classes = getattr(est, "classes_", None)
    link = "identity" if classes is None else ("sigmoid" if K == 1 else "softmax")
    return TreeEnsemble(d, K, trees, np.asarray(base, np.float64), False, link, classes, name)


#: LightGBM's threshold for "zero vs. positive" (kZeroThreshold).
_LGB_ZERO = 1e-30


def from_lightgbm(model) -> TreeEnsemble:
    """A LightGBM ``Booster`` or ``LGBMClassifier``/``LGBMRegressor``."""
    booster = getattr(model, "booster_", model)
    dump = booster.dump_model()
    objective = str(dump.get("objective", "")).split()
    kind = objective[0] if objective else ""
    K = int(dump["num_tree_per_iteration"])
    scale = 1.0
    if kind in ("binary", "cross_entropy"):
        link = "sigmoid"
        for o in objective[1:]:
            if o.startswith("sigmoid:"):
                scale = float(o.split(":")[1])
    elif kind == "multiclass":
        link = "softmax"
    elif kind in ("regression", "regression_l1", "huber", "fair", "quantile", "mape"):
        link = "identity"
    else:
        raise WindTunnelError(f"LightGBM objective {kind!r} is not supported (binary, multiclass and the "
                              "identity-link regressions are)")
    if dump.get("average_output"):
        scale /= max(len(dump["tree_info"]) // K, 1)
    trees = []
    for i, info in enumerate(dump["tree_info"]):
        tr = Tree(output=i % K)

        def split(n):
            if n["decision_type"] != "<=":
                raise WindTunnelError(f"LightGBM categorical split ({n['decision_type']!r}) in tree {i}: "
                                      "one-hot encode the column before LightGBM instead")
            thr = float(n["threshold"])
            zero_left = thr >= 0
            if n.get("missing_type") == "Zero" and zero_left != bool(n["default_left"]):
                raise WindTunnelError(f"LightGBM zero_as_missing split in tree {i} sends 0 against its "
                                      "threshold; train without zero_as_missing")
            return n["split_feature"], thr, abs(thr) < _LGB_ZERO

        def is_leaf(n):
            if "leaf_value" in n and "leaf_coeff" in n:
                raise WindTunnelError("LightGBM linear trees (linear_tree=True) are not supported")
            return "leaf_value" in n

        root = info["tree_structure"]
        _scale_lgb(root, scale)
        _walk(root, is_leaf, split, lambda n: (n["left_child"], n["right_child"]), tr, [])
        trees.append(tr)
    n_features = int(dump["max_feature_idx"]) + 1
    classes = getattr(model, "classes_", None)
    if link == "sigmoid" and classes is not None and len(classes) != 2:
        raise WindTunnelError("LightGBM binary objective with more than two classes")
    ens = TreeEnsemble(n_features, K, trees, np.zeros(K), False, link, classes, type(model).__name__)
    zero = np.zeros((1, n_features))
    ens.base = np.asarray(booster.predict(zero, raw_score=True), np.float64).reshape(K) - ens.raw(zero)[0]
    return ens


def _scale_lgb(node: dict, scale: float) -> None:
    """LightGBM leaves as {"value": ...} records, scaled by the sigmoid/average factor."""
    if "leaf_value" in node:
        node["value"] = scale * float(node["leaf_value"])
    else:
        _scale_lgb(node["left_child"], scale)
        _scale_lgb(node["right_child"], scale)


_XGB_LINKS = {"binary:logistic": "sigmoid", "multi:softprob": "softmax", "multi:softmax": "softmax",
              "reg:squarederror": "identity", "reg:absoluteerror": "identity",
              "reg:pseudohubererror": "identity"}


def from_xgboost(model) -> TreeEnsemble:
    """An XGBoost ``Booster`` or ``XGBClassifier``/``XGBRegressor`` (``gbtree``)."""
    import xgboost as xgb
    booster = model.get_booster() if hasattr(model, "get_booster") else model
    config = json.loads(booster.save_config())["learner"]
    if config["gradient_booster"]["name"] != "gbtree":
        raise WindTunnelError(f"XGBoost booster {config['gradient_booster']['name']!r} is not supported "
                              "(gbtree is)")
    objective = config["objective"]["name"]
    if objective not in _XGB_LINKS:
        raise WindTunnelError(f"XGBoost objective {objective!r} is not supported ({', '.join(_XGB_LINKS)} are)")
    link = _XGB_LINKS[objective]
    K = max(int(config["learner_model_param"].get("num_class", "0")), 1)
    tree_info = json.loads(booster.save_raw("json"))["learner"]["gradient_booster"]["model"]["tree_info"]
    names = booster.feature_names
    index = {n: i for i, n in enumerate(names)} if names else {}
    n_features = booster.num_features()

    def feature(split: str) -> int:
        if split in index:
            return index[split]
        if split.startswith("f") and split[1:].isdigit():
            return int(split[1:])
        raise WindTunnelError(f"XGBoost split on unknown feature {split!r}")

    def split(n):
        if "categories" in n or n.get("split_type") == "categorical":
            raise WindTunnelError("XGBoost categorical split: one-hot encode the column before XGBoost instead")
        # XGBoost goes left ("yes") when x < condition: thresholds are data values (cut points)
        return feature(n["split"]), float(np.float32(n["split_condition"])), True

    def children(n):
        by_id = {c["nodeid"]: c for c in n["children"]}
        return by_id[n["yes"]], by_id[n["no"]]

    trees = []
    for i, text in enumerate(booster.get_dump(dump_format="json")):
        tr = Tree(output=int(tree_info[i]) if K > 1 else 0)
        root = json.loads(text)
        _xgb_values(root)
        _walk(root, lambda n: "leaf" in n, split, children, tr, [])
        trees.append(tr)
    classes = getattr(model, "classes_", None)
    ens = TreeEnsemble(n_features, K, trees, np.zeros(K), True, link, classes, type(model).__name__)
    zero = np.zeros((1, n_features), np.float32)
    margin = booster.predict(xgb.DMatrix(zero, feature_names=names), output_margin=True)
    ens.base = np.asarray(margin, np.float64).reshape(K) - ens.raw(zero)[0]
    return ens


def _xgb_values(node: dict) -> None:
    if "leaf" in node:
        node["value"] = float(node["leaf"])
    for c in node.get("children", []):
        _xgb_values(c)
