"""``paella experiment windtunnel``: one small setting end to end, and the paper's gains
as computed from its tables."""
from __future__ import annotations

import pytest

from paella.experiments import windtunnel as exp


def test_a_small_setting_runs_end_to_end():
    cfg = {"rows": 1500, "trees": 5, "epochs": 2}
    r, net = exp.run_setting("synthetic", "gbdt", cfg, seed=2)
    aucs = {k: v for k, v in r.items() if k.startswith("auc_")}
    assert set(aucs) == {"auc_original", "auc_oracle", "auc_translated_exact", "auc_translated", "auc_finetuned",
                         "auc_model_scope", "auc_cold", "auc_cold_model", "auc_finetuned_exact"}
    assert all(0.5 < v <= 1.0 for v in aucs.values())
    assert r["decisions_equal_exact"] >= 0.99
    assert r["auc_translated_exact"] == pytest.approx(r["auc_original"], abs=2e-3)
    assert r["auc_oracle"] >= max(aucs.values()) - 0.02          # nothing beats the truth by much
    assert r["runs"]["finetuned"]["val_loss_best"] <= r["runs"]["finetuned"]["val_loss_start"]
    assert r["rows"] == {"train": 900, "val": 300, "test": 300}
    assert net.output(r["test"]["X"][:3]).shape == (3, 2)


def test_paper_gains_from_its_tables():
    g = exp.paper_gains()
    assert g["table_5_3"]["Criteo Pre2"]["pipe2"] == pytest.approx(0.8053 / 0.7781 - 1)
    assert g["table_5_3_range"]["pipe1"] == pytest.approx([0.6910 / 0.6847 - 1, 0.7588 / 0.6896 - 1])
    assert g["table_5_4"]["Pre3"]["gbdt2nn_over_ml"] == pytest.approx(0.7998 / 0.7925 - 1)
    assert min(g["table_5_5"].values()) == pytest.approx(0.8041 / 0.7990 - 1)
