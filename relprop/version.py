"""The version of relprop (also read by the packaging)."""

__version__ = "0.1.0"
