from .trace import Trace, TraceConfig, TraceRequest, UserEvents, generate_trace

__all__ = ["Trace", "TraceConfig", "TraceRequest", "UserEvents", "generate_trace"]
