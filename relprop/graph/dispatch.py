"""Models dispatched by accelerate: captured and run without moving them, one weight at a time.

A checkpoint larger than a device is loaded with ``from_pretrained(..., device_map="auto",
max_memory=..., offload_folder=...)`` (or ``accelerate.cpu_offload`` / ``disk_offload`` /
``dispatch_model``): the parameters of offloaded modules are storage-less ``meta`` tensors and
each such module carries an accelerate hook (``module._hf_hook``, an ``AlignDevicesHook``) whose
``weights_map`` holds the real values (in CPU memory, or on disk behind an offload index). In the
model's own forward, the hook loads a module's weights onto its execution device just before the
module runs and drops them after it.

relprop runs the captured graph itself, so it never calls the hooks. Instead:

* **Capture** (:func:`export_offloaded`): a *structural copy* of the model (:func:`structure_of`:
  the same modules and code, no accelerate hook, each offloaded weight replaced by a stand-in on
  the execution device that holds one element broadcast to the weight's shape; every other tensor
  shared, not copied) is exported on the inputs. The graph is the one of the model on that device;
  the model itself is neither called nor changed.
* **Run** (:class:`OffloadedWeights`, :class:`LazyEnv`): the graph's parameter and buffer inputs are
  not bound up front; each is read from the hook's ``weights_map`` (moved to the execution device,
  cast to the parameter's dtype as accelerate does) when a node needs it, and dropped after that
  node. While autograd records a forward pass, a weight it saves for the backward pass is stored
  as its name and read again when the backward pass needs it
  (:meth:`OffloadedWeights.saved_by_name`), so the weights are never all resident at once, as in
  accelerate's own forward pass without gradients.

Supported: one execution device (CPU, or one GPU) with any mix of weights on it, in CPU memory and
on disk. Weights on several devices (a model split over GPUs) raise :class:`DispatchError`: the
captured graph has no device transfers between layers.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.fx

from ..errors import DispatchError
from .export import ATTEMPTS, export_program
from .program import Program

#: what to do about a model on several devices, for the message of :class:`DispatchError`
SUPPORTED = ("relprop explains a dispatched model whose modules all execute on one device (one GPU or the CPU), "
             "with any of its weights offloaded to CPU memory or to disk: load it with e.g. "
             "device_map='auto', max_memory={0: '20GiB', 'cpu': '60GiB'} (one GPU) and offload_folder=... for the "
             "rest, or device_map={'': 0}")


def _hooks(module: torch.nn.Module) -> List[Any]:
    """The accelerate hooks of ``module`` (a ``SequentialHook`` unpacked), found by duck typing so
    that accelerate stays optional."""
    hook = module.__dict__.get("_hf_hook")
    if hook is None:
        return []
    return list(getattr(hook, "hooks", None) or [hook])


def is_dispatched(model: torch.nn.Module) -> bool:
    """Whether some module of ``model`` carries an accelerate hook."""
    return any("_hf_hook" in m.__dict__ for m in model.modules())


def _device(d: Any) -> Optional[torch.device]:
    if d is None:
        return None
    return d if isinstance(d, torch.device) else torch.device(d)


@dataclasses.dataclass
class OffloadedWeights:
    """Where the value of each ``meta`` parameter or buffer of a dispatched model lives: its
    accelerate hook's ``weights_map`` and the key there. :meth:`fetch` reads one value."""

    device: torch.device
    #: tensor name (as in ``named_parameters``) -> (weights_map, key, dtype of the parameter)
    sources: Dict[str, Tuple[Any, str, torch.dtype]]
    #: storage address -> (name, weak reference to the fetched tensor): the weights fetched so far
    _fetched: Dict[int, Tuple[str, Any]] = dataclasses.field(default_factory=dict, repr=False)

    def fetch(self, name: str) -> torch.Tensor:
        """The value of the offloaded tensor ``name`` on the execution device (read from CPU memory
        or disk now; nothing keeps it once the caller drops it)."""
        wm, key, dtype = self.sources[name]
        v = wm[key]
        if v.is_floating_point() and dtype.is_floating_point and v.dtype != dtype:
            v = v.to(dtype)  # as accelerate's set_module_tensor_to_device does
        v = v.to(self.device).detach()
        self._fetched = {p: e for p, e in self._fetched.items() if e[1]() is not None}
        self._fetched[v.untyped_storage().data_ptr()] = (name, weakref.ref(v))
        return v

    @contextlib.contextmanager
    def saved_by_name(self) -> Iterator[None]:
        """While active, autograd saves a fetched weight (or a view of it) as its name and layout,
        and the backward pass fetches it again (``torch.autograd.graph.saved_tensors_hooks``)."""
        def pack(t: torch.Tensor):
            ptr = t.untyped_storage().data_ptr()
            entry = self._fetched.get(ptr)
            base = entry[1]() if entry is not None else None
            if base is None or base.dtype != t.dtype or base.untyped_storage().data_ptr() != ptr:
                return t
            return _Saved(entry[0], tuple(t.shape), tuple(t.stride()), t.storage_offset())

        def unpack(x):
            if isinstance(x, _Saved):
                return self.fetch(x.name).as_strided(x.shape, x.stride, x.offset)
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


@dataclasses.dataclass(frozen=True)
class _Saved:
    name: str
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int


def offloaded_weights(model: torch.nn.Module) -> Optional[OffloadedWeights]:
    """The :class:`OffloadedWeights` of a model dispatched by accelerate with some weights offloaded
    (``meta`` parameters or buffers), None for any other model (no accelerate hook, or hooks that
    only move the inputs: the model's weights are all on one device and the usual path serves it).

    Raises :class:`DispatchError` when the modules execute on several devices, or when a ``meta``
    tensor has no hook that holds its value."""
    if not is_dispatched(model):
        return None
    devices = set()
    holders: Dict[str, Any] = {}  # module name -> its hook's weights_map
    for name, m in model.named_modules():
        for h in _hooks(m):
            d = _device(getattr(h, "execution_device", None))
            if d is not None:
                devices.add(d)
            if getattr(h, "weights_map", None) is not None:
                holders[name] = h.weights_map
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    devices |= {t.device for _, t in tensors if t.device.type != "meta"}
    if len(devices) > 1:
        raise DispatchError(f"{type(model).__name__} is dispatched over several devices "
                            f"({', '.join(sorted(map(str, devices)))}): {SUPPORTED}")
    meta = [(n, t) for n, t in tensors if t.device.type == "meta"]
    if not meta:
        return None
    if not devices:
        raise DispatchError(f"{type(model).__name__}'s accelerate hooks name no execution device: {SUPPORTED}")
    sources = {}
    for name, t in meta:
        parts = name.split(".")
        for i in range(len(parts) - 1, -1, -1):  # the innermost module whose hook holds the value
            owner = ".".join(parts[:i])
            wm = holders.get(owner)
            key = ".".join(parts[i:])
            if wm is not None and _holds(wm, key):
                sources[name] = (wm, key, t.dtype)
                break
        else:
            raise DispatchError(f"{type(model).__name__}.{name} is on the meta device and no accelerate hook holds "
                                "its value: its weights were never loaded (e.g. a model built under "
                                "init_empty_weights). Load the checkpoint, e.g. with from_pretrained(..., "
                                "device_map=...), or accelerate.load_checkpoint_and_dispatch")
    return OffloadedWeights(next(iter(devices)), sources)


def _holds(weights_map: Any, key: str) -> bool:
    try:
        return key in weights_map
    except Exception:  # noqa: BLE001 - a mapping that cannot answer does not hold it
        return False


def structure_of(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A copy of ``model``'s module tree (same classes, code, attributes and config) without its
    accelerate hooks, whose ``meta`` parameters and buffers are stand-ins on ``device``: one element
    broadcast to the tensor's shape (stride 0), so that the model's code takes the branches it takes
    on that device. Every other tensor is shared with ``model``, not copied (tied parameters stay
    tied); no offloaded weight is read, and ``model`` is not changed."""
    memo: Dict[int, Any] = {}
    for m in model.modules():
        for k in ("_hf_hook", "_old_forward", "forward"):
            if k in m.__dict__:
                memo[id(m.__dict__[k])] = None
    for _, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        if id(t) in memo:
            continue
        if t.device.type == "meta":
            stand_in = torch.zeros((), dtype=t.dtype, device=device).expand(t.shape)
            is_param = isinstance(t, torch.nn.Parameter)
            memo[id(t)] = torch.nn.Parameter(stand_in, t.requires_grad) if is_param else stand_in
        else:
            memo[id(t)] = t
    try:
        twin = copy.deepcopy(model, memo)
    except Exception as e:  # noqa: BLE001 - any object the model holds may refuse a copy
        raise DispatchError(f"{type(model).__name__} is dispatched by accelerate and relprop could not copy its "
                            f"module tree to capture it ({type(e).__name__}: {str(e)[:300]})") from None
    for m in twin.modules():
        for k in ("_hf_hook", "_old_forward", "forward"):
            m.__dict__.pop(k, None)
    return twin


class LazyEnv(dict):
    """The values of a graph's nodes where some placeholders (offloaded weights) are read when a
    node reads them, never kept: ``env[node]``, ``node in env`` and ``env.get(node)`` see them,
    iteration does not."""

    def __init__(self, values: Dict[torch.fx.Node, Any], lazy: Dict[torch.fx.Node, Callable[[], Any]],
                 weights: OffloadedWeights):
        super().__init__(values)
        self.lazy = lazy
        self.weights = weights

    def __missing__(self, node):
        fetch = self.lazy.get(node)
        if fetch is None:
            raise KeyError(node)
        return fetch()

    def __contains__(self, node) -> bool:
        return dict.__contains__(self, node) or node in self.lazy

    def get(self, node, default=None):
        if dict.__contains__(self, node):
            return dict.__getitem__(self, node)
        fetch = self.lazy.get(node)
        return fetch() if fetch is not None else default

    def copy(self) -> "LazyEnv":
        return LazyEnv(dict(self), self.lazy, self.weights)


def saving_by_name(env: Any):
    """The context in which autograd saves ``env``'s offloaded weights by name
    (:meth:`OffloadedWeights.saved_by_name`); a no-op for any other env."""
    return env.weights.saved_by_name() if isinstance(env, LazyEnv) else contextlib.nullcontext()


def bind_offloaded(bindings, weights: OffloadedWeights, constants: Dict[str, torch.Tensor], model: torch.nn.Module,
                   kwargs: Dict[str, Any]) -> LazyEnv:
    """Placeholder values of a graph of a dispatched model: its offloaded parameters and buffers
    read on demand (:class:`LazyEnv`), the rest (tensors on the execution device, lifted constants,
    the user's inputs) bound at once."""
    values, lazy = {}, {}
    for node, kind, target in bindings:
        if kind in ("param", "buffer"):
            if target in weights.sources:
                lazy[node] = _fetcher(weights, target)
            else:
                t = model.get_parameter(target) if kind == "param" else model.get_buffer(target)
                values[node] = t.detach()
        elif kind == "constant":
            values[node] = constants[target]
        else:
            v = kwargs[target]
            values[node] = v.detach() if torch.is_tensor(v) else v
    return LazyEnv(values, lazy, weights)


def _fetcher(weights: OffloadedWeights, name: str) -> Callable[[], torch.Tensor]:
    return lambda: weights.fetch(name)


def export_offloaded(model: torch.nn.Module, weights: OffloadedWeights, kwargs: Dict[str, Any], primary: str,
                     state: tuple, timings: Dict[str, float], attempts=ATTEMPTS,
                     failed: Optional[List[str]] = None) -> Program:
    """The :class:`Program` of a dispatched model with offloaded weights: its structural copy
    (:func:`structure_of`: stand-ins for the offloaded weights on the execution device) exported on
    the inputs. Never read from or written to the disk cache. ``failed`` as in :func:`export_program`."""
    program = export_program(structure_of(model, weights.device), kwargs, primary, state, timings, attempts,
                             failed)
    program.offloaded = True
    return program
