"""Fine-tuning: warm start improves (or keeps) the loss, scopes and levels freeze what
they say, the cold start is the same architecture with other values."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # a safety net: `make install` installs the windtunnel extra

from sklearn.compose import ColumnTransformer
from sklearn.ensemble import GradientBoostingClassifier, GradientBoostingRegressor
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import KBinsDiscretizer, OneHotEncoder, StandardScaler

from paella.windtunnel import FitConfig, WindTunnelError, finetune, translate
from paella.windtunnel.data import synthetic
from paella.windtunnel.finetune import evaluate
from paella.windtunnel.trees import SoftTrees


@pytest.fixture(scope="module")
def data():
    return synthetic(1500, seed=3).split(seed=3)


@pytest.fixture(scope="module")
def pipe(data):
    tr, _, _ = data
    ct = ColumnTransformer([("num", StandardScaler(), tr.numeric),
                            ("bins", KBinsDiscretizer(n_bins=4, encode="onehot"), [2]),
                            ("cat", OneHotEncoder(handle_unknown="ignore"), tr.categorical)])
    return Pipeline([("ct", ct), ("gb", GradientBoostingClassifier(n_estimators=20, max_depth=3, random_state=0))]
                    ).fit(tr.X, tr.y)


def _values(net):
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def test_warm_finetuning_lowers_the_training_loss(pipe, data):
    tr, _, _ = data
    net = translate(pipe, tau=1.0, reference=tr.X)
    res = finetune(net, tr.X, tr.y, config=FitConfig(epochs=6, lr=3e-3))
    assert len(res.train_loss) == 7
    assert res.train_loss[-1] < 0.95 * res.train_loss[0]
    assert evaluate(net, tr.X, tr.y) == pytest.approx(res.train_loss[-1], rel=1e-5)


def test_validation_never_worse_than_the_translation(pipe, data):
    """With validation rows the best state is restored, the translated one included."""
    tr, va, _ = data
    net = translate(pipe, tau=1.0, reference=tr.X)
    res = finetune(net, tr.X, tr.y, va.X, va.y, FitConfig(epochs=5, lr=3e-2, patience=2))
    assert min(res.val_loss) == pytest.approx(evaluate(net, va.X, va.y), rel=1e-5)
    assert evaluate(net, va.X, va.y) <= res.val_loss[0] + 1e-7
    assert res.val_loss[res.best_epoch] == min(res.val_loss)


def test_model_scope_freezes_the_featurizers(pipe, data):
    tr, _, _ = data
    net = translate(pipe, tau=1.0, reference=tr.X)
    before = _values(net)
    finetune(net, tr.X, tr.y, config=FitConfig(epochs=1, scope="model"))
    after = _values(net)
    feat = [k for k in before if ".branches." in k and not k.endswith(("mask", "combine", "offset", "slot_value"))]
    assert feat, "the pipeline has featurizer parameters"
    assert all(torch.equal(before[k], after[k]) for k in feat)
    assert not torch.equal(before["body.steps.1.v"], after["body.steps.1.v"])
    assert all(p.requires_grad for p in net.parameter_groups()["featurizers"])   # unfrozen again


@pytest.mark.parametrize("level,trained", [(1, {"v", "c"}), (2, {"v", "c", "b1"}),
                                           (4, {"v", "c", "b1", "w1", "w2", "b2"})])
def test_parametrization_levels(level, trained, data):
    tr, _, _ = data
    gb = GradientBoostingClassifier(n_estimators=5, max_depth=2, random_state=0).fit(tr.X, tr.y)
    net = translate(gb, tau=1.0, reference=tr.X, level=level)
    before = _values(net)
    finetune(net, tr.X, tr.y, config=FitConfig(epochs=1, lr=1e-2))
    changed = {k for k, v in _values(net).items() if not torch.equal(v, before[k])}
    assert changed == {f"body.{k}" for k in trained}


def test_padding_stays_zero_through_training(data):
    tr, _, _ = data
    gb = GradientBoostingRegressor(n_estimators=6, max_depth=3, min_samples_leaf=150, random_state=0)
    gb.fit(tr.X, tr.logit)
    net = translate(gb, tau=1.0)
    trees: SoftTrees = net.body
    assert (trees.m2 == 0).any(), "trees of unequal sizes: some padding"
    finetune(net, tr.X, tr.logit, config=FitConfig(epochs=2, lr=1e-2))
    with torch.no_grad():
        assert torch.all((trees.w2 * trees.m2)[trees.m2 == 0] == 0)
        assert torch.all((trees.v * trees.mv)[trees.mv == 0] == 0)


def test_cold_start_same_architecture_other_values(pipe, data):
    tr, _, _ = data
    warm = translate(pipe, tau=1.0, reference=tr.X)
    cold = warm.cold_start(seed=1)
    ws, cs = warm.state_dict(), cold.state_dict()
    assert ws.keys() == cs.keys() and all(ws[k].shape == cs[k].shape for k in ws)
    params = [n for n, p in warm.named_parameters()]
    assert sum(not torch.equal(ws[n], cs[n]) for n in params) == len(params)
    assert [p.requires_grad for p in warm.parameters()] == [p.requires_grad for p in cold.parameters()]
    assert torch.equal(cold.cold_start(seed=1).state_dict()["body.steps.1.w1"],
                       warm.cold_start(seed=1).state_dict()["body.steps.1.w1"])
    res = finetune(cold, tr.X, tr.y, config=FitConfig(epochs=4, lr=3e-3))
    assert res.train_loss[-1] < res.train_loss[0]


def test_seeded_finetuning_is_repeatable(pipe, data):
    tr, _, _ = data
    nets = [translate(pipe, tau=1.0, reference=tr.X) for _ in range(2)]
    for n in nets:
        finetune(n, tr.X, tr.y, config=FitConfig(epochs=1, dropout=0.1, seed=7))
    np.testing.assert_array_equal(nets[0].output(tr.X), nets[1].output(tr.X))


def test_bad_labels_and_scope_are_refused(pipe, data):
    tr, _, _ = data
    net = translate(pipe, tau=1.0)
    with pytest.raises(WindTunnelError, match="classes"):
        finetune(net, tr.X, tr.y + 5, config=FitConfig(epochs=1))
    with pytest.raises(WindTunnelError, match="scope"):
        finetune(net, tr.X, tr.y, config=FitConfig(epochs=1, scope="featurizers"))
