"""Fine-tuning (paper §5.2.4): every translated operator trained jointly by backpropagation.

Adam on mini-batches, the loss of the pipeline's task on the network's raw scores
(binary cross-entropy on the logit, cross-entropy over classes, squared error for
regression), weight decay and dropout as in the paper's setting (§5.4.1: Adam, weight
decay 1e-6, dropout 0.1 on the hidden layers). With validation rows, training stops
once the validation loss has not improved for ``patience`` epochs and the best state
is restored; the state before the first step is a candidate too, so fine-tuning never
returns a network worse on the validation loss than the translated one.

``scope="model"`` trains only the blocks translated from models and freezes the
featurizers: the paper's GBDT2NN row (Table 5.4). Warm start is the translated
network itself; the cold start of Table 5.5 is ``finetune(net.cold_start(seed), ...)``.

Runs on the CPU; RNG state is forked, so a seeded call is repeatable and leaves the
caller's torch RNG alone.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .errors import WindTunnelError
from .network import WindTunnelNet


@dataclass
class FitConfig:
    """Defaults: the paper's §5.4.1 setting (Adam, weight decay 1e-6, dropout 0.1) with the
    learning rate, epochs and patience that ``experiment windtunnel`` uses."""
    epochs: int = 40
    lr: float = 1e-3
    batch_size: int = 256
    weight_decay: float = 1e-6
    dropout: float = 0.1
    patience: int = 6
    scope: str = "all"              # "all": joint; "model": featurizers frozen (GBDT2NN)
    seed: int = 0


@dataclass
class FitResult:
    """Per-epoch losses (entry 0: before training), the restored epoch and the time taken."""
    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    best_epoch: int = 0
    seconds: float = 0.0


def targets(net: WindTunnelNet, y: np.ndarray) -> torch.Tensor:
    """Labels as the loss wants them: class indices (classifiers) or float values."""
    y = np.asarray(y)
    if net.link == "identity":
        t = torch.as_tensor(y, dtype=torch.float32)
        return t.reshape(len(y), -1)
    classes = net.classes if net.classes is not None else np.arange(max(net.out_dim, 2))
    idx = np.searchsorted(classes, y)
    if np.any(idx >= len(classes)) or np.any(classes[np.minimum(idx, len(classes) - 1)] != y):
        raise WindTunnelError(f"labels outside the pipeline's classes {list(classes)}")
    return torch.as_tensor(idx, dtype=torch.long)


def loss_of(net: WindTunnelNet, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    if net.link == "sigmoid":
        return F.binary_cross_entropy_with_logits(z[:, 0], t.to(z.dtype))
    if net.link == "softmax":
        return F.cross_entropy(z, t)
    return F.mse_loss(z, t)


def evaluate(net: WindTunnelNet, X: np.ndarray, y: np.ndarray) -> float:
    """The task's mean loss over rows ``X`` in evaluation mode (no dropout)."""
    was = net.training
    net.eval()
    try:
        with torch.no_grad():
            return float(loss_of(net, net.logits(torch.as_tensor(np.asarray(X, np.float32))), targets(net, y)))
    finally:
        net.train(was)


def finetune(net: WindTunnelNet, X: np.ndarray, y: np.ndarray, X_val: np.ndarray | None = None,
             y_val: np.ndarray | None = None, config: FitConfig = FitConfig()) -> FitResult:
    """Train ``net`` in place on ``(X, y)``; return the loss history."""
    if config.scope not in ("all", "model"):
        raise WindTunnelError(f"fine-tuning scope {config.scope!r} is not 'all' or 'model'")
    groups = net.parameter_groups()
    params = groups["model"] + (groups["featurizers"] if config.scope == "all" else [])
    frozen = [p for p in groups["featurizers"] if config.scope == "model"]
    if not params:
        raise WindTunnelError("nothing to train: every parameter is frozen")
    t0 = time.perf_counter()
    Xt = torch.as_tensor(np.asarray(X, np.float32))
    yt = targets(net, y)
    has_val = X_val is not None and y_val is not None
    res = FitResult(train_loss=[evaluate(net, X, y)], val_loss=[evaluate(net, X_val, y_val)] if has_val else [])
    best_state, best = copy.deepcopy(net.state_dict()), (res.val_loss[0] if has_val else np.inf)
    for p in frozen:
        p.requires_grad_(False)
    net.set_dropout(config.dropout)
    opt = torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(config.seed)
            gen = torch.Generator().manual_seed(config.seed)
            stale = 0
            for epoch in range(1, config.epochs + 1):
                net.train()
                for idx in torch.randperm(len(Xt), generator=gen).split(config.batch_size):
                    opt.zero_grad()
                    loss_of(net, net.logits(Xt[idx]), yt[idx]).backward()
                    opt.step()
                res.train_loss.append(evaluate(net, X, y))
                if not has_val:
                    continue
                res.val_loss.append(evaluate(net, X_val, y_val))
                if res.val_loss[-1] < best:
                    best, res.best_epoch, stale = res.val_loss[-1], epoch, 0
                    best_state = copy.deepcopy(net.state_dict())
                else:
                    stale += 1
                    if stale >= config.patience:
                        break
    finally:
        net.set_dropout(0.0)
        net.eval()
        for p in frozen:
            p.requires_grad_(True)
    if has_val:
        net.load_state_dict(best_state)
    else:
        res.best_epoch = len(res.train_loss) - 1
    res.seconds = time.perf_counter() - t0
    return res
