"""The device seam: streams, events and buffer lifetimes (``runtime.py``: the protocol and the
CPU runtime; ``cuda.py``: CUDA streams and events)."""
