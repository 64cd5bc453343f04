"""fledge: EAGLE-3 speculative decoding that pays off, and says by how much."""

__version__ = "0.1.0"
