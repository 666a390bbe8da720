"""A second device on a CPU-only machine, so tests can catch code that mixes the host with the runner's device.

Inside :func:`second_device`, tensors "on the device" report ``device == DEVICE`` (``meta``) but hold their
values on the host, and every aten op checks its tensor arguments the way CUDA does: an op that meets a tensor
on the device and a host tensor with one or more dimensions raises ``RuntimeError("Expected all tensors to be
on the same device ...")``. What CUDA allows passes: host 0-dim tensors (scalars), host index tensors in
advanced indexing (``x[i]``, ``x[i] = v``), and explicit copies between the two (``.to(device)``,
``.cpu()``, ``copy_``). Factories called with ``device=DEVICE`` make device tensors; ``.tolist()``,
``.item()`` and ``int()`` read values as they would (with a sync) on a GPU.

Invariant: code that runs here without an error makes no host/device mix that CUDA would refuse, and computes
the same values it computes on the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
            return func(args[0].host, *args[1:], **kwargs)  # a GPU would sync here and give the same values
        if func is torch.Tensor.to:
            target = kwargs.get("device", next((a for a in args[1:] if _is_device(a) or isinstance(a, str)), None))
            if target is not None and _is_device(target):
                args = tuple(torch.device("cpu") if _is_device(a) else a for a in args)
                kwargs = {k: torch.device("cpu") if _is_device(v) else v for k, v in kwargs.items()}
                result = func(*args, **kwargs)
                return result if isinstance(result, DeviceTensor) else DeviceTensor(result)
            return func(*args, **kwargs)
        if _is_device(kwargs.get("device")):
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
            host = [x for x in host if id(x) not in index_ids]
        if on_device and host and func not in _CROSS_DEVICE_COPIES:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, {DEVICE} and cpu! "
                f"(in {func}, host tensor of shape {tuple(host[0].shape)})"
            )
        to_device = kwargs.get("device") == DEVICE
        to_host = func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu")
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
