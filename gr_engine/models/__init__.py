"""Models served by the engine."""

from .hstu import AttendFn, HSTULayer, HSTUModel

__all__ = ["AttendFn", "HSTULayer", "HSTUModel"]
