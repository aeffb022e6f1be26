"""The simulated GPU (device backend ``sim``): see hardware.py for the model."""
from .clock import EventLoop, RealTimeLoop
from .cost import CostModel
from .device import SimDevice

__all__ = ["SimDevice", "CostModel", "EventLoop", "RealTimeLoop"]
