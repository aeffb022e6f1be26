"""Translation: with a small tau the network takes the pipeline's decisions, on seeded
random pipelines of every supported operator; unsupported operators are named."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")  # a safety net: `make install` installs the windtunnel extra

import lightgbm as lgb
import xgboost as xgb
from sklearn.compose import ColumnTransformer
from sklearn.ensemble import GradientBoostingClassifier, GradientBoostingRegressor, RandomForestClassifier
from sklearn.impute import SimpleImputer
from sklearn.linear_model import LinearRegression, LogisticRegression, Ridge
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import KBinsDiscretizer, OneHotEncoder, StandardScaler

from paella.windtunnel import WindTunnelError, translate
from paella.windtunnel.trees import TreeEnsemble, from_lightgbm, from_sklearn_gb, from_xgboost

TAU = 1e-4


def _data(rng: np.random.Generator, n: int) -> tuple[np.ndarray, list[int], list[int]]:
    """Continuous columns of random scales, one integer column (ties), categorical codes."""
    n_num = int(rng.integers(2, 5))
    num = rng.normal(rng.uniform(-50, 50, n_num), rng.uniform(0.1, 100, n_num), (n, n_num))
    ints = rng.integers(0, 6, (n, 1))
    n_cat = int(rng.integers(1, 3))
    cats = np.column_stack([rng.integers(0, int(rng.integers(2, 7)), n) for _ in range(n_cat)])
    X = np.column_stack([num, ints, cats]).astype(np.float32)
    return X, list(range(n_num + 1)), list(range(n_num + 1, n_num + 1 + n_cat))


def _featurizer(rng: np.random.Generator, numeric: list[int], categorical: list[int]) -> ColumnTransformer:
    def numeric_step():
        k = int(rng.integers(4))
        if k == 0:
            return StandardScaler()
        bins = KBinsDiscretizer(n_bins=int(rng.integers(3, 7)), encode=str(rng.choice(["ordinal", "onehot"])),
                                strategy=str(rng.choice(["uniform", "quantile"])),
                                quantile_method="averaged_inverted_cdf")
        return bins if k == 1 else (Pipeline([("s", StandardScaler()), ("b", bins)]) if k == 2 else "passthrough")
    drop = rng.choice([None, "first", "if_binary"])
    cat = OneHotEncoder(drop=drop, handle_unknown="ignore" if drop is None else "error")
    split = int(rng.integers(1, len(numeric)))
    return ColumnTransformer([("a", numeric_step(), numeric[:split]), ("b", numeric_step(), numeric[split:]),
                              ("cat", cat, categorical)],
                             remainder=str(rng.choice(["drop", "passthrough"])))


MODELS = ["logistic", "linear", "ridge", "gb", "gb3", "gbr", "lgb", "lgb3", "lgbr", "xgb", "xgb3", "xgbr"]


def _model(kind: str, seed: int):
    return {"logistic": lambda: LogisticRegression(max_iter=500),
            "linear": LinearRegression, "ridge": Ridge,
            "gb": lambda: GradientBoostingClassifier(n_estimators=15, max_depth=3, random_state=seed),
            "gb3": lambda: GradientBoostingClassifier(n_estimators=8, max_depth=2, random_state=seed),
            "gbr": lambda: GradientBoostingRegressor(n_estimators=15, max_depth=3, random_state=seed),
            "lgb": lambda: lgb.LGBMClassifier(n_estimators=15, num_leaves=8, min_child_samples=5, verbose=-1, n_jobs=1),
            "lgb3": lambda: lgb.LGBMClassifier(n_estimators=8, num_leaves=6, min_child_samples=5, verbose=-1, n_jobs=1),
            "lgbr": lambda: lgb.LGBMRegressor(n_estimators=15, num_leaves=8, min_child_samples=5, verbose=-1, n_jobs=1),
            "xgb": lambda: xgb.XGBClassifier(n_estimators=15, max_depth=3, n_jobs=1),
            "xgb3": lambda: xgb.XGBClassifier(n_estimators=8, max_depth=2, n_jobs=1),
            "xgbr": lambda: xgb.XGBRegressor(n_estimators=15, max_depth=3, n_jobs=1)}[kind]()


def _labels(kind: str, X: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    z = (X - X.mean(0)) / (X.std(0) + 1e-9) @ rng.standard_normal(X.shape[1]) + 0.3 * rng.standard_normal(len(X))
    if kind.endswith("3"):
        return np.digitize(z, np.quantile(z, [1 / 3, 2 / 3]))
    if kind in ("logistic", "gb", "lgb", "xgb"):
        return (z > np.median(z)).astype(int)
    return z


@pytest.mark.filterwarnings("ignore:Bins whose width are too small")
@pytest.mark.parametrize("seed", range(24))
def test_random_pipeline_decisions_match(seed):
    rng = np.random.default_rng(seed)
    kind = MODELS[seed % len(MODELS)]
    rows, numeric, categorical = _data(rng, 800)
    X, fresh = rows[:400], rows[400:]                          # fresh: same columns, unseen rows
    y = _labels(kind, X, rng)
    pipe = Pipeline([("features", _featurizer(rng, numeric, categorical)), ("model", _model(kind, seed))])
    pipe.fit(X, y)
    net = translate(pipe, tau=TAU, reference=X)
    fresh = fresh[np.isin(fresh[:, categorical], X[:, categorical]).all(1)]  # known categories only
    # A row changes only if a column it reads lies within a few tau of a threshold: rare
    # for unseen rows, and for reference rows only where the data's own gap is that small.
    for rows in (X, fresh):
        if hasattr(pipe, "predict_proba"):
            assert np.mean(net.predict(rows) == pipe.predict(rows)) >= 0.99
            gap = np.abs(net.output(rows) - pipe.predict_proba(rows)).max(axis=1)
        else:
            gap = np.abs(net.predict(rows) - pipe.predict(rows)) / np.abs(y).max()
        assert np.mean(gap < 1e-4) >= 0.99
        assert np.median(gap) < 1e-5


@pytest.mark.parametrize("convert,fit", [
    (from_sklearn_gb, lambda X, y: GradientBoostingClassifier(n_estimators=10).fit(X, y)),
    (from_lightgbm, lambda X, y: lgb.LGBMClassifier(n_estimators=10, verbose=-1, n_jobs=1).fit(X, y)),
    (from_xgboost, lambda X, y: xgb.XGBClassifier(n_estimators=10, n_jobs=1).fit(X, y)),
])
def test_hard_trees_equal_the_framework(convert, fit):
    """The framework-neutral record reproduces each library's raw scores exactly."""
    rng = np.random.default_rng(5)
    X = np.column_stack([rng.standard_normal((300, 2)), rng.integers(0, 4, (300, 2))]).astype(np.float32)
    y = ((X[:, 0] + X[:, 2] > 1) ^ (X[:, 3] == 2)).astype(int)
    model = fit(X, y)
    ens: TreeEnsemble = convert(model)
    p = 1 / (1 + np.exp(-ens.raw(X)[:, 0]))
    np.testing.assert_allclose(p, model.predict_proba(X)[:, 1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fit", [
    lambda X, y: lgb.LGBMClassifier(n_estimators=20, num_leaves=8, min_child_samples=3, verbose=-1, n_jobs=1).fit(X, y),
    lambda X, y: xgb.XGBClassifier(n_estimators=20, max_depth=3, n_jobs=1).fit(X, y),
])
def test_ties_on_integer_data_without_reference(fit):
    """LightGBM's zero threshold and XGBoost's cut points sit on data values; without
    reference rows the steps move one tau towards the framework's tie side."""
    rng = np.random.default_rng(2)
    X = rng.integers(0, 4, (500, 3)).astype(np.float32)
    y = ((X[:, 0] == 0) | (X[:, 1] + X[:, 2] >= 4)).astype(int)
    model = fit(X, y)
    net = translate(model, tau=1e-3)
    np.testing.assert_allclose(net.output(X), model.predict_proba(X), atol=1e-4)


def test_smoothing_grows_with_tau():
    """tau trades exactness for smoothness: the gap to the pipeline grows with it."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((400, 3)).astype(np.float32)
    y = (X[:, 0] * X[:, 1] > 0).astype(int)
    gb = GradientBoostingClassifier(n_estimators=20, max_depth=3, random_state=0).fit(X, y)
    gaps = [np.abs(translate(gb, tau=t, reference=X).output(X) - gb.predict_proba(X)).mean()
            for t in (1e-4, 0.1, 1.0)]
    assert gaps[0] < 1e-5 < gaps[1] < gaps[2]


@pytest.mark.parametrize("step,name", [
    (SimpleImputer(), "SimpleImputer"),
    (RandomForestClassifier(n_estimators=3), "RandomForestClassifier"),
])
def test_unsupported_estimator_is_named(step, name):
    X = np.random.default_rng(0).standard_normal((50, 3)).astype(np.float32)
    y = (X[:, 0] > 0).astype(int)
    steps = [("s", step), ("m", LogisticRegression())] if name == "SimpleImputer" else [("m", step)]
    pipe = Pipeline(steps).fit(X, y)
    with pytest.raises(WindTunnelError, match=name) as e:
        translate(pipe)
    assert "supported:" in str(e.value)


def test_string_categories_and_categorical_splits_are_refused():
    X = np.array([["a"], ["b"], ["a"], ["c"]] * 10, dtype=object)
    enc = Pipeline([("oh", OneHotEncoder()), ("m", LogisticRegression())]).fit(X, [0, 1, 0, 1] * 10)
    with pytest.raises(WindTunnelError, match="non-numeric categories"):
        translate(enc)
    rng = np.random.default_rng(0)
    Xc = np.column_stack([rng.integers(0, 10, 400), rng.standard_normal(400)]).astype(np.float32)
    yc = np.isin(Xc[:, 0], (1, 4, 7)).astype(int)
    model = lgb.LGBMClassifier(n_estimators=5, verbose=-1, n_jobs=1, min_data_per_group=5, cat_smooth=1)
    model.fit(Xc, yc, categorical_feature=[0])
    with pytest.raises(WindTunnelError, match="categorical split"):
        translate(model)


def test_pipeline_ending_in_a_transform_is_refused():
    X = np.random.default_rng(0).standard_normal((20, 2)).astype(np.float32)
    with pytest.raises(WindTunnelError, match="ends in StandardScaler"):
        translate(Pipeline([("s", StandardScaler())]).fit(X))


def test_xgboost_behind_a_sparse_matrix_is_refused():
    """XGBoost reads the zeros of a sparse matrix as missing values; dense input works."""
    rng = np.random.default_rng(0)
    X = np.column_stack([rng.integers(0, 30, 400), rng.integers(0, 30, 400)]).astype(np.float32)
    y = (X[:, 0] % 3 == 0).astype(int)
    sparse = Pipeline([("oh", OneHotEncoder()), ("m", xgb.XGBClassifier(n_estimators=5, n_jobs=1))]).fit(X, y)
    with pytest.raises(WindTunnelError, match="sparse matrix of OneHotEncoder.*sparse_output=False"):
        translate(sparse)
    dense = Pipeline([("oh", OneHotEncoder(sparse_output=False)),
                      ("m", xgb.XGBClassifier(n_estimators=5, n_jobs=1))]).fit(X, y)
    np.testing.assert_allclose(translate(dense, tau=1e-3, reference=X).output(X), dense.predict_proba(X), atol=1e-5)


def test_bin_softness_is_relative_to_the_bin_width():
    """Columns of very different scales bin exactly at one small tau."""
    rng = np.random.default_rng(1)
    X = np.column_stack([rng.normal(0, 0.01, 500), rng.normal(0, 1000, 500)]).astype(np.float32)
    y = (X[:, 0] * 100 + X[:, 1] / 1000 > 0).astype(int)
    pipe = Pipeline([("b", KBinsDiscretizer(n_bins=6, encode="onehot")), ("m", LogisticRegression())]).fit(X, y)
    fresh = np.column_stack([rng.normal(0, 0.01, 500), rng.normal(0, 1000, 500)]).astype(np.float32)
    net = translate(pipe, tau=1e-4, reference=X)
    assert np.mean(np.abs(net.output(fresh) - pipe.predict_proba(fresh)).max(1) < 1e-4) >= 0.99
