"""Model families: the adapters that fit a family's inputs and outputs to relprop's generic spine
(:mod:`relprop.models.adapter`, the protocol; :mod:`relprop.models.registry`, which adapter explains a model;
:mod:`relprop.models.families`, the vision-language families), and the modules that know each family."""
from .adapter import PLAIN, Adapted, ModelAdapter
from .registry import ADAPTERS, adapter_for, register, unregister

__all__ = ["ADAPTERS", "Adapted", "ModelAdapter", "PLAIN", "adapter_for", "register", "unregister"]
