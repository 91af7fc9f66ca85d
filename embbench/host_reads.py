"""The ATen operator calls that make the host read a device value, found on any device.

On CUDA such a call waits for the device (a host synchronisation) and breaks CUDA graph
capture; ``torch.cuda.set_sync_debug_mode`` reports it, but only on a GPU. Fake tensors catch
most of them on a CPU (a data-dependent output size or ``.item()`` raises), but not the ops
whose kernels read a tensor-valued "scalar" argument on the host: fake tensors, meta tensors
and inductor decompose those into device-side copies. :class:`HostReadCheck` names each call
by its ATen overload and arguments, so a CPU test of real tensors fails on all of them.

What reads a device value on the host (read in ATen's kernels, torch 2.x):

- ``_local_scalar_dense``: ``.item()``, ``int(t)``, ``bool(t)``, ``float(t)``, a tensor used
  as a Python number (a slice bound, ``torch.full``'s value); ``is_nonzero`` and ``equal``
  return a host bool.
- An output sized by the data: ``nonzero`` (``argwhere``, ``where(cond)``), ``masked_select``,
  every ``unique`` (``_unique``, ``_unique2``, ``unique_dim``, ``unique_consecutive``),
  ``bincount`` (its length is the maximum), ``repeat_interleave`` without ``output_size``, and
  indexing (``index``, ``index_put_``) with a boolean mask, which runs ``nonzero`` first.
- A tensor-valued scalar overload whose kernel calls ``value.item()``: ``index_fill.int_Tensor``
  (every device), ``masked_fill.Tensor`` (CUDA), ``fill_.Tensor`` when the value is on
  another device than ``self``; ``histc`` on CUDA with ``min == max`` (it reads the range);
  ``tensor_split`` by a tensor of indices and ``narrow`` by a tensor start (read on the host).

Not visible to a dispatch mode on a CPU: a device-to-host copy (``.cpu()``, ``.tolist()``,
``.numpy()``) is a no-op or no operator there; the fake-tensor test catches those.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostRead", "HostReadCheck", "host_read"]

aten = torch.ops.aten

#: Operator packets every overload of which reads a device value on the host.
_ALWAYS = {
    "_local_scalar_dense": "reads a value on the host (.item(), int(t), a tensor used as a number)",
    "is_nonzero": "returns a host bool",
    "equal": "returns a host bool",
    "nonzero": "an output sized by the data",
    "nonzero_numpy": "an output sized by the data",
    "argwhere": "an output sized by the data",
    "masked_select": "an output sized by the data",
    "_unique": "an output sized by the data",
    "_unique2": "an output sized by the data",
    "unique_dim": "an output sized by the data",
    "unique_consecutive": "an output sized by the data",
    "unique_dim_consecutive": "an output sized by the data",
    "bincount": "an output sized by the data (its maximum)",
    "tensor_split": "reads split indices on the host",
}

#: Single overloads whose kernel reads their tensor-valued scalar with ``.item()``.
_TENSOR_SCALARS = {
    "index_fill.int_Tensor", "index_fill_.int_Tensor", "index_fill.Dimname_Tensor", "index_fill_.Dimname_Tensor",
    "masked_fill.Tensor", "masked_fill_.Tensor", "narrow.Tensor",
}


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def host_read(func, args: tuple, kwargs: dict) -> str | None:
    """Why this ATen call reads a device value on the host (on CUDA), or None if it does not."""
    packet, overload = func._schema.name.split("::")[-1], func._overloadname
    name = f"{packet}.{overload}"
    if packet in _ALWAYS:
        return _ALWAYS[packet]
    if name in _TENSOR_SCALARS:
        return "reads its tensor-valued scalar with .item(): use the Python number, or index_copy_ of the expanded tensor"
    if packet in ("fill", "fill_") and overload == "Tensor":
        if args[1].device != args[0].device:
            return "reads a value of another device with .item()"
    if packet == "repeat_interleave" and overload.startswith("Tensor"):
        if kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None):
            return "an output sized by the data (pass output_size)"
    if packet in ("index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index", "_unsafe_index_put"):
        if any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1] if len(args) > 1 else kwargs.get("indices"))):
            return "boolean-mask indexing (runs nonzero: an output sized by the data)"
    if packet == "histc":
        low, high = (list(args[2:4]) + [kwargs.get("min", 0), kwargs.get("max", 0)])[:2]
        if low == high:
            return "min == max: reads the data's range on the host"
    return None


class HostRead(AssertionError):
    """An operator call that would make the host wait for the device on CUDA."""


class HostReadCheck(TorchDispatchMode):
    """Inside it, an ATen call that reads a device value on the host raises :class:`HostRead`
    naming the overload (or, with ``record=True``, is appended to :attr:`found`)."""

    def __init__(self, record: bool = False):
        super().__init__()
        self.record = record
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = host_read(func, args, kwargs)
        if why is not None:
            message = f"{func}: {why}"
            if not self.record:
                raise HostRead(message)
            self.found.append(message)
        return func(*args, **kwargs)
