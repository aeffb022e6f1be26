"""WindTunnel: classical ML pipelines translated into neural networks, fine-tuned end to
end, exported to ONNX and served by the Paella daemon (docs/windtunnel.md).

    net = translate(pipeline, reference=X_train)      # same decisions, differentiable
    finetune(net, X_train, y_train, X_val, y_val)     # warm start; net.cold_start() for the ablation
    compile_network(net, "bundles/wt", batch=64)      # then `paella serve --models bundles`

Needs the optional extra ``paella-py[windtunnel]`` (PyTorch, scikit-learn, LightGBM,
XGBoost).
"""
from __future__ import annotations

from .errors import EXTRA_HINT, WindTunnelError

try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover - the extra is installed by `make install`
    raise WindTunnelError(f"paella.windtunnel needs PyTorch ({e}); {EXTRA_HINT}") from None

from .export import compile_network, run_onnx, save_onnx, to_onnx
from .finetune import FitConfig, FitResult, finetune
from .network import WindTunnelNet
from .pipeline import DEFAULT_TAU, translate

__all__ = ["DEFAULT_TAU", "FitConfig", "FitResult", "WindTunnelError", "WindTunnelNet", "compile_network",
           "finetune", "run_onnx", "save_onnx", "to_onnx", "translate"]
