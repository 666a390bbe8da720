"""A second device on a CPU-only machine, so tests can catch code that mixes the host with the runner's device.

Inside :func:`second_device`, tensors "on the device" report ``device == DEVICE`` (``meta``) but hold their
values on the host, and every aten op checks its tensor arguments the way CUDA does: an op that meets a tensor
on the device and a host tensor with one or more dimensions raises ``RuntimeError("Expected all tensors to be
on the same device ...")``. What CUDA allows passes: host 0-dim tensors (scalars), host index tensors in
advanced indexing (``x[i]``, ``x[i] = v``), and explicit copies between the two (``.to(device)``,
``.cpu()``, ``copy_``). Factories called with ``device=DEVICE`` make device tensors; ``.tolist()``,
``.item()`` and ``int()`` read values as they would (with a sync) on a GPU.

Inside :func:`counting_syncs` as well, device tensors say ``is_cuda``, ``torch.cuda.synchronize`` and
``torch.cuda.Event`` are stand-ins, and every call that would make the host wait for a GPU is counted: a
synchronize (of the device or of an event), a read of a device tensor's values on the host (``tolist``,
``item``, ``int``/``float``/``bool``, ``.cpu()``, ``.to("cpu")``, ``.numpy()``), and a blocking copy of host
values to the device (``.to(device)`` without ``non_blocking``, ``torch.tensor(data, device=...)``, a host index
tensor in advanced indexing), which on CUDA waits for the stream.

Invariant: code that runs here without an error makes no host/device mix that CUDA would refuse, and computes
the same values it computes on the host.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("meta")

_CROSS_DEVICE_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default,
                        torch.ops.aten.copy.default}
# ops whose index tensors CUDA takes from the host (advanced indexing)
_HOST_INDICES_ALLOWED = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default,
                         torch.ops.aten.index_put_.default, torch.ops.aten._index_put_impl_.default}


class DeviceTensor(torch.Tensor):
    """A tensor on :data:`DEVICE` whose values live on the host (in ``host``)."""

    host: torch.Tensor
    reports_cuda = False  # True inside counting_syncs(): code that asks ``is_cuda`` takes its GPU path

    @property
    def is_cuda(self) -> bool:
        return DeviceTensor.reports_cuda

    @staticmethod
    def __new__(cls, host: torch.Tensor) -> DeviceTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, host.shape, strides=host.stride(), storage_offset=host.storage_offset(), dtype=host.dtype,
            device=DEVICE, requires_grad=False,
        )
        wrapper.host = host
        return wrapper

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError("DeviceTensor is used only inside second_device()")

    def __repr__(self) -> str:
        return f"DeviceTensor({self.host!r})"


_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__float__,
          torch.Tensor.__bool__, torch.Tensor.__index__}


def _is_device(value) -> bool:
    return isinstance(value, torch.device | str) and torch.device(value) == DEVICE


class _DeviceFactories(TorchFunctionMode):
    """Calls that make a tensor on :data:`DEVICE` (``device=`` of any factory, ``Tensor.to``) make it on the host
    and wrap it: a real ``meta`` tensor would hold no values."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _READS and args and isinstance(args[0], DeviceTensor):
            _count_wait(f"Tensor.{func.__name__}")
            return func(args[0].host, *args[1:], **kwargs)  # a GPU would sync here and give the same values
        if func is torch.Tensor.numpy and args and isinstance(args[0], DeviceTensor):
            _count_wait("Tensor.numpy")
            return args[0].host.numpy(*args[1:], **kwargs)
        if func is torch.Tensor.to:
            target = kwargs.get("device", next((a for a in args[1:] if _is_device(a) or isinstance(a, str)), None))
            if target is not None and _is_device(target):
                if not isinstance(args[0], DeviceTensor) and not kwargs.get("non_blocking", False):
                    _count_wait("a blocking copy to the device (Tensor.to without non_blocking)")
                args = tuple(torch.device("cpu") if _is_device(a) else a for a in args)
                kwargs = {k: torch.device("cpu") if _is_device(v) else v for k, v in kwargs.items()}
                with _not_counted():  # a copy to the device: the host's copy of its values is ours, not a read
                    result = func(*args, **kwargs)
                return result if isinstance(result, DeviceTensor) else DeviceTensor(result)
            return func(*args, **kwargs)
        if _is_device(kwargs.get("device")):
            if func in (torch.tensor, torch.as_tensor):
                _count_wait(f"a blocking copy to the device ({func.__name__} of host data)")
            kwargs["device"] = torch.device("cpu")
            return tree_map(lambda x: DeviceTensor(x) if isinstance(x, torch.Tensor) else x, func(*args, **kwargs))
        return func(*args, **kwargs)


class _SecondDevice(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        flat, _ = tree_flatten((args, kwargs))
        on_device = any(isinstance(x, DeviceTensor) for x in flat)
        host = [x for x in flat if isinstance(x, torch.Tensor) and not isinstance(x, DeviceTensor) and x.dim() > 0]
        if func in _HOST_INDICES_ALLOWED and on_device:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            index_ids = {id(i) for i in indices if isinstance(i, torch.Tensor)}
            if any(id(x) in index_ids for x in host):
                _count_wait(f"a host index copied to the device ({func})")
            host = [x for x in host if id(x) not in index_ids]
        if on_device and host and func not in _CROSS_DEVICE_COPIES:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, {DEVICE} and cpu! "
                f"(in {func}, host tensor of shape {tuple(host[0].shape)})"
            )
        to_device = kwargs.get("device") == DEVICE
        to_host = func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu")
        if to_host and on_device or (func is torch.ops.aten.copy_.default and on_device
                                     and not isinstance(args[0], DeviceTensor)):
            _count_wait(f"copy to the host ({func})")
        if to_device:
            kwargs["device"] = torch.device("cpu")
        unwrapped_args, unwrapped_kwargs = tree_map(
            lambda x: x.host if isinstance(x, DeviceTensor) else x, (args, kwargs)
        )
        result = func(*unwrapped_args, **unwrapped_kwargs)
        if func is torch.ops.aten.copy_.default:
            return args[0]  # copied in place into the destination's (host) values
        if to_host or not (on_device or to_device):
            return result
        return tree_map(lambda x: DeviceTensor(x) if isinstance(x, torch.Tensor) else x, result)


@contextlib.contextmanager
def second_device() -> Iterator[torch.device]:
    """Within: :data:`DEVICE` behaves as a second device (module docstring); yields it."""
    with _SecondDevice(), _DeviceFactories():
        yield DEVICE


def on_host(x):
    """The host values of a device tensor (a host tensor as it is), outside :func:`second_device` too."""
    return x.host if isinstance(x, DeviceTensor) else x


@dataclass
class SyncCount:
    """What :func:`counting_syncs` saw: each wait with where it came from (the innermost project frame)."""

    waits: list[tuple[str, str]] = field(default_factory=list)  # (what, file:line)

    def __len__(self) -> int:
        return len(self.waits)

    def describe(self) -> str:
        return "; ".join(f"{what} at {where}" for what, where in self.waits) or "none"


_active_count: SyncCount | None = None


_counting_paused = False


@contextlib.contextmanager
def _not_counted() -> Iterator[None]:
    global _counting_paused
    previous, _counting_paused = _counting_paused, True
    try:
        yield
    finally:
        _counting_paused = previous


def _count_wait(what: str) -> None:
    if _active_count is None or _counting_paused:
        return
    frames = [f for f in traceback.extract_stack()[:-2] if "vllm_easyspec" in f.filename]
    where = f"{frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno}" if frames else "?"
    _active_count.waits.append((what, where))


class _StandInEvent:
    """``torch.cuda.Event`` on the stand-in device: work on it is done when it is queued, so a recorded event
    has always been passed (``query()``); waiting for one is counted."""

    _clock = 0.0

    def __init__(self, enable_timing: bool = False, **_: object) -> None:
        self.time: float | None = None

    def record(self, stream: object = None) -> None:
        _StandInEvent._clock += 1.0
        self.time = _StandInEvent._clock

    def query(self) -> bool:
        return self.time is not None

    def synchronize(self) -> None:
        _count_wait("Event.synchronize")

    def elapsed_time(self, end: _StandInEvent) -> float:
        assert self.time is not None and end.time is not None, "elapsed_time of an event never recorded"
        return end.time - self.time  # milliseconds


@contextlib.contextmanager
def counting_syncs() -> Iterator[SyncCount]:
    """Within (and within :func:`second_device`): device tensors report ``is_cuda``, and every call that would
    make the host wait for a GPU is counted in the yielded :class:`SyncCount` (module docstring)."""
    global _active_count
    count = SyncCount()
    previous, _active_count = _active_count, count
    DeviceTensor.reports_cuda = True
    try:
        with mock.patch("torch.cuda.synchronize", lambda *a, **k: _count_wait("torch.cuda.synchronize")), \
                mock.patch("torch.cuda.Event", _StandInEvent):
            yield count
    finally:
        DeviceTensor.reports_cuda = False
        _active_count = previous
