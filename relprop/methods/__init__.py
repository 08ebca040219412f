"""Explanation methods, each a small pure function of the per-block records (DESIGN §4)."""
from .registry import all_methods, get_method, method, MethodInfo  # noqa: F401
from . import transformer_attribution  # noqa: F401,E402
