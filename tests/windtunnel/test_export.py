"""ONNX export: the graph computes what the torch network computes, before and after
fine-tuning, and the same weights give the same bytes (the compile cache relies on it)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")  # a safety net: `make install` installs the windtunnel extra

import onnx
import xgboost as xgb
from sklearn.compose import ColumnTransformer
from sklearn.ensemble import GradientBoostingClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import KBinsDiscretizer, OneHotEncoder, StandardScaler

from paella.windtunnel import FitConfig, finetune, run_onnx, to_onnx, translate
from paella.windtunnel.data import synthetic


@pytest.fixture(scope="module")
def data():
    return synthetic(1000, seed=4).split(seed=4)


def _features(d):
    return ColumnTransformer([("num", StandardScaler(), d.numeric[:4]),
                              ("ord", KBinsDiscretizer(n_bins=5, encode="ordinal"), [4]),
                              ("hot", KBinsDiscretizer(n_bins=3, encode="onehot-dense"), [5]),
                              ("cat", OneHotEncoder(handle_unknown="ignore", drop="first"), d.categorical)])


def _nets(d):
    """A GBDT pipeline, a multiclass logistic pipeline, an XGBoost regressor."""
    gb = Pipeline([("f", _features(d)), ("m", GradientBoostingClassifier(n_estimators=10, random_state=0))])
    three = np.digitize(d.logit, [-0.5, 0.5])
    lr = Pipeline([("f", _features(d)), ("m", LogisticRegression(max_iter=500))])
    xr = xgb.XGBRegressor(n_estimators=10, max_depth=3, n_jobs=1)
    return {"gbdt": translate(gb.fit(d.X, d.y), tau=1.0, reference=d.X),
            "logistic3": translate(lr.fit(d.X, three), tau=1.0, reference=d.X),
            "xgb_regressor": translate(xr.fit(d.X, d.logit), tau=0.1, reference=d.X)}


def test_onnx_equals_torch_before_and_after_finetuning(data):
    tr, _, te = data
    for name, net in _nets(tr).items():
        y = {"identity": tr.logit, "softmax": np.digitize(tr.logit, [-0.5, 0.5]), "sigmoid": tr.y}[net.link]
        translated = net.output(te.X)
        for stage in ("translated", "fine-tuned"):
            if stage == "fine-tuned":
                finetune(net, tr.X, y, config=FitConfig(epochs=2, lr=1e-2))
                assert np.abs(net.output(te.X) - translated).max() > 1e-3, name
            model = to_onnx(net, batch=len(te.X))
            got, want = run_onnx(model, te.X), net.output(te.X)
            assert got.shape == want.shape == (len(te.X), net.out_dim)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{name}, {stage}")


def test_export_is_deterministic_and_static(data):
    tr, _, _ = data
    net = _nets(tr)["gbdt"]
    a, b = to_onnx(net, 8), to_onnx(net, 8)
    assert a.SerializeToString() == b.SerializeToString()
    dims = [d.dim_value for d in a.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [8, tr.X.shape[1]]
    assert {n.op_type for n in a.graph.node} <= {"Gather", "Equal", "Cast", "MatMul", "Add", "Mul", "Tanh",
                                                 "Reshape", "Transpose", "ReduceSum", "Concat", "Sigmoid", "Sub", "Identity"}
    onnx.checker.check_model(a)
