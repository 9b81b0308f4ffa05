"""The device seam: streams, events and buffer lifetimes (see ``runtime.py``)."""
