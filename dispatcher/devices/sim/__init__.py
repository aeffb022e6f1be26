"""The simulated GPU (device backend ``sim``): see hardware.py for the model."""
from .clock import EventLoop, RealTimeLoop
from .cost import CostModel
from .device import SimDevice
from .process import SimProcessDevice

__all__ = ["SimDevice", "SimProcessDevice", "CostModel", "EventLoop", "RealTimeLoop"]
