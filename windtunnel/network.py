"""The translated network: blocks, their composition, and the output link.

A translated pipeline is a tree of :class:`Block` s, one per translated operator,
composed the way the pipeline composes its steps: :class:`Chain` for a ``Pipeline``,
:class:`Columns` for a ``ColumnTransformer``. The last block produces raw scores
(a logit, a margin, a regression value); :class:`WindTunnelNet` adds the link that
turns them into what the pipeline's ``predict_proba`` or ``predict`` returns.

Every block knows three things besides its forward pass, so that fine-tuning, the
cold-start ablation and the export can treat the network uniformly:

* ``featurizer``: whether it was translated from a data transform (scaling, encoding,
  binning) or from a model; fine-tuning with ``scope="model"`` freezes the former
  (the paper's GBDT2NN row, Table 5.4);
* :meth:`Block.cold_init`: the same parameters drawn at random (Table 5.5's cold start);
* :meth:`Block.to_onnx`: the same computation as ONNX nodes (``export.py``).
"""
from __future__ import annotations

import copy
from typing import Any, Iterator, Protocol

import numpy as np
import torch
from torch import nn

#: How a network's raw scores become its output.
LINKS = ("identity", "sigmoid", "softmax")


class OnnxBuilder(Protocol):
    """What :meth:`Block.to_onnx` writes into: constants and nodes, each named uniquely,
    each method returning the name of the value it made. Declared here, beside the
    blocks that use it, so that the blocks need not know the exporter
    (:class:`~.export.OnnxGraph`, which imports the network, is the implementation)."""

    def const(self, value: np.ndarray, hint: str = "c") -> str: ...

    def weight(self, value: torch.Tensor, hint: str = "w") -> str: ...

    def op(self, op_type: str, inputs: list[str], **attrs: Any) -> str: ...


class Block(nn.Module):
    """One translated operator. Subclasses set ``in_dim``/``out_dim`` and implement
    ``forward``, ``to_onnx`` and ``cold_init``."""

    #: Translated from a data transform (frozen under ``scope="model"``).
    featurizer: bool = False

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.dropout = 0.0

    def to_onnx(self, g: OnnxBuilder, x: str) -> str:
        """Emit this block's computation on the ONNX value ``x``; return the output's name."""
        raise NotImplementedError

    def cold_init(self, gen: torch.Generator) -> None:
        """Redraw this block's own parameters at random (PyTorch's default schemes)."""
        raise NotImplementedError

    def blocks(self) -> Iterator["Block"]:
        """This block and every block inside it."""
        yield self


def uniform_(p: torch.Tensor, fan_in: int, gen: torch.Generator) -> None:
    """``nn.Linear``'s default init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), from ``gen``."""
    bound = 1.0 / max(fan_in, 1) ** 0.5
    with torch.no_grad():
        p.copy_(torch.empty_like(p).uniform_(-bound, bound, generator=gen))


def param(values: np.ndarray) -> nn.Parameter:
    """A float32 parameter from translated values."""
    return nn.Parameter(torch.as_tensor(np.asarray(values, dtype=np.float32)))


class Chain(Block):
    """Blocks applied in order (a translated ``Pipeline``)."""

    def __init__(self, steps: list[Block]):
        super().__init__(steps[0].in_dim, steps[-1].out_dim)
        for a, b in zip(steps, steps[1:]):
            if a.out_dim != b.in_dim:
                raise ValueError(f"{type(a).__name__} gives {a.out_dim} columns, {type(b).__name__} takes {b.in_dim}")
        self.steps = nn.ModuleList(steps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self.steps:
            x = s(x)
        return x

    def to_onnx(self, g: OnnxBuilder, x: str) -> str:
        for s in self.steps:
            x = s.to_onnx(g, x)
        return x

    def cold_init(self, gen: torch.Generator) -> None:
        pass  # no parameters of its own

    def blocks(self) -> Iterator[Block]:
        yield self
        for s in self.steps:
            yield from s.blocks()


class Columns(Block):
    """Column subsets, each through its own block (or passed through), concatenated (a
    translated ``ColumnTransformer``)."""

    def __init__(self, in_dim: int, branches: list[tuple[list[int], Block | None]]):
        out = sum(len(c) if b is None else b.out_dim for c, b in branches)
        super().__init__(in_dim, out)
        self.columns = [list(map(int, c)) for c, _ in branches]
        for c, b in branches:
            if b is not None and b.in_dim != len(c):
                raise ValueError(f"{type(b).__name__} takes {b.in_dim} columns, given {len(c)}")
        self.branches = nn.ModuleList([b if b is not None else nn.Identity() for _, b in branches])
        for k, c in enumerate(self.columns):
            self.register_buffer(f"idx{k}", torch.as_tensor(c, dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([b(x.index_select(1, getattr(self, f"idx{k}")))
                          for k, b in enumerate(self.branches)], dim=1)

    def to_onnx(self, g: OnnxBuilder, x: str) -> str:
        outs = []
        for c, b in zip(self.columns, self.branches):
            sub = g.op("Gather", [x, g.const(np.asarray(c, np.int64), "cols")], axis=1)
            outs.append(sub if isinstance(b, nn.Identity) else b.to_onnx(g, sub))
        return outs[0] if len(outs) == 1 else g.op("Concat", outs, axis=1)

    def cold_init(self, gen: torch.Generator) -> None:
        pass

    def blocks(self) -> Iterator[Block]:
        yield self
        for b in self.branches:
            if isinstance(b, Block):
                yield from b.blocks()


class WindTunnelNet(nn.Module):
    """A translated pipeline: ``body`` gives raw scores, ``link`` the served output.

    ``link`` is ``identity`` (regression: the predicted values, one column per target),
    ``sigmoid`` (binary classification: ``[1 - p, p]``, as ``predict_proba``) or
    ``softmax`` (multiclass: one probability per class). ``classes`` maps an output
    column to the pipeline's label. ``source`` names what was translated.
    """

    def __init__(self, body: Block, link: str, classes: np.ndarray | None = None, source: str = ""):
        super().__init__()
        if link not in LINKS:
            raise ValueError(f"link {link!r} is not one of {LINKS}")
        self.body = body
        self.link = link
        self.classes = None if classes is None else np.asarray(classes)
        self.source = source

    @property
    def in_dim(self) -> int:
        return self.body.in_dim

    @property
    def out_dim(self) -> int:
        return 2 if self.link == "sigmoid" else self.body.out_dim

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Raw scores, what the fine-tuning loss reads (a logit per row for ``sigmoid``)."""
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.body(x)
        if self.link == "sigmoid":
            p = torch.sigmoid(z)
            return torch.cat([1 - p, p], dim=1)
        if self.link == "softmax":
            return torch.softmax(z, dim=1)
        return z

    def to_onnx(self, g: OnnxBuilder, x: str) -> str:
        z = self.body.to_onnx(g, x)
        if self.link == "sigmoid":
            p = g.op("Sigmoid", [z])
            return g.op("Concat", [g.op("Sub", [g.const(np.ones(1, np.float32), "one"), p]), p], axis=1)
        if self.link == "softmax":
            return g.op("Softmax", [z], axis=1)
        return z

    # ---- numpy conveniences (what the tests and the experiment compare) ---------------
    def output(self, X: np.ndarray) -> np.ndarray:
        """The served output for rows ``X`` (float32), in evaluation mode."""
        was = self.training
        self.eval()
        try:
            with torch.no_grad():
                return self(torch.as_tensor(np.asarray(X, np.float32))).numpy()
        finally:
            self.train(was)

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Labels (classifiers) or values (regressors), as the pipeline's ``predict``."""
        out = self.output(X)
        if self.link == "identity":
            return out[:, 0] if out.shape[1] == 1 else out
        k = out.argmax(axis=1)
        return k if self.classes is None else self.classes[k]

    def blocks(self) -> Iterator[Block]:
        return self.body.blocks()

    def set_dropout(self, p: float) -> None:
        """Dropout probability of every hidden layer (used in training mode only)."""
        for b in self.blocks():
            b.dropout = p

    def cold_start(self, seed: int = 0, scope: str = "all") -> "WindTunnelNet":
        """The same architecture with parameters drawn at random: Table 5.5's cold start.
        ``scope="model"`` redraws only the blocks translated from models and keeps the
        translated featurizers. Trainability (the GBDT parametrization level) is kept."""
        if scope not in ("all", "model"):
            raise ValueError(f"cold-start scope {scope!r} is not 'all' or 'model'")
        net = copy.deepcopy(self)
        gen = torch.Generator().manual_seed(seed)
        for b in net.blocks():
            if scope == "all" or not b.featurizer:
                b.cold_init(gen)
        return net

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """Trainable parameters of the featurizer blocks and of the model blocks."""
        out: dict[str, list[nn.Parameter]] = {"featurizers": [], "model": []}
        for b in self.blocks():
            own = [p for p in b.parameters(recurse=False) if p.requires_grad]
            out["featurizers" if b.featurizer else "model"].extend(own)
        return out
