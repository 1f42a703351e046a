"""Models served by the engine."""

from .layers import AttendFn, HSTULayer, SASRecLayer
from .model import GRModel

__all__ = ["AttendFn", "GRModel", "HSTULayer", "SASRecLayer"]
