"""An "npu" device for the fake, backed by CPU tensors: what lets a whole training run take the NPU code path.

Like the real torch_npu, it renames torch's PrivateUse1 backend to "npu" and registers torch.npu, so
torch.device("npu", 0), tensor.to("npu") and tensor.device.type == "npu" all work. An npu tensor is a wrapper
around a CPU tensor; every aten op on it unwraps, runs on the CPU and wraps the result. The rename cannot be
undone in a process, so this is only installed in a subprocess (FAKE_NPU_TENSORS=1).
"""

from __future__ import annotations

import sys

import npu_wheel
import torch
from torch.utils._pytree import tree_map
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

_aten = torch.ops.aten
# Ops whose result is host data (a Python scalar or bool), not a tensor to wrap.
_HOST_RESULTS = (_aten._local_scalar_dense.default, _aten.equal.default, _aten.is_same_size.default)
_libraries: list[torch.library.Library] = []  # kept alive: a Library's registrations end with it


def _device(index: int | None = None) -> torch.device:
    return torch.device("npu", 0 if index is None else index)


class NpuTensor(torch.Tensor):
    """A tensor on the fake npu device; its data is the CPU tensor `_data` with the same shape and strides."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, index: int = 0):
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device=_device(index), requires_grad=data.requires_grad,
        )
        wrapper._data = data
        # Lazy conjugation / negation are flags on the tensor, not data: the wrapper carries them too (complex
        # autograd, e.g. the reference rotary's backward, produces conjugate views).
        torch._C._set_conj(wrapper, data.is_conj())
        torch._C._set_neg(wrapper, data.is_neg())
        return wrapper

    def __repr__(self) -> str:
        return f"NpuTensor({self._data!r})"

    def untyped_storage(self) -> torch.UntypedStorage:
        """The CPU storage underneath: FSDP frees and re-allocates unsharded parameters by resizing it."""
        return self._data.untyped_storage()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}

        def unwrap(x):
            if isinstance(x, NpuTensor):
                return x._data
            if isinstance(x, torch.device) and x.type == "npu":
                return torch.device("cpu")
            return x

        _check_fused_kernel(func)
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if func in _HOST_RESULTS:
            return out
        target = kwargs.get("device")
        if func is _aten._to_copy.default and target is not None and torch.device(target).type == "cpu":
            return out  # npu -> cpu copy
        if not func._schema.returns:
            return None  # an op that only writes its arguments (fsdp::split_with_sizes_copy, _fused_adamw_)
        if func._schema.is_mutable and args and isinstance(args[0], NpuTensor):
            return args[0]  # in-place: the caller keeps its tensor
        return tree_map(lambda x: NpuTensor(x) if isinstance(x, torch.Tensor) else x, out)


def _check_fused_kernel(func) -> None:
    """A fused optimizer kernel (aten::_fused_*) runs on npu only in an overload the wheel registers; counted."""
    name = func._schema.name.split("::", 1)[-1]
    if not name.startswith("_fused_"):
        return
    key = name if func._overloadname == "default" else f"{name}.{func._overloadname}"
    if key not in npu_wheel.schemas()["supported"]:
        raise RuntimeError(f"{key}: torch_npu {npu_wheel.TORCH_NPU_VERSION} registers no NPU kernel for it")
    sys.modules["torch_npu"].calls[key] += 1


class _NpuFactories(torch.overrides.TorchFunctionMode):
    """Factory calls with device="npu" and no tensor argument (torch.arange, torch.zeros, ...) run on the CPU and wrap
    their result (one with a tensor argument, e.g. a DTensor's empty_like, dispatches to the npu kernels);
    pinning host memory for the device is a no-op.

    Some factories create an empty tensor and then resize it in place, which a wrapper cannot follow, so they
    are caught before dispatch rather than at the PrivateUse1 kernels.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.pin_memory:
            return args[0]  # host memory needs no pinning for a device that lives in host memory
        if func in (torch.Tensor.tolist, torch.Tensor.numpy) and isinstance(args[0], NpuTensor):
            return func(args[0]._data.detach(), *args[1:], **kwargs)  # host copies, which subclasses cannot make
        device = kwargs.get("device")
        if device is None or torch.device(device).type != "npu" or any(isinstance(a, torch.Tensor) for a in args):
            return func(*args, **kwargs)
        out = func(*args, **{**kwargs, "device": "cpu"})
        return tree_map(lambda x: NpuTensor(x) if isinstance(x, torch.Tensor) else x, out)


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return NpuTensor(torch.empty(size, dtype=dtype, memory_format=memory_format))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return NpuTensor(torch.empty_strided(size, stride, dtype=dtype))


def install(backend_module) -> None:
    """Make "npu" a device whose tensors live in CPU memory, with `backend_module` as torch.npu."""
    _setup_privateuseone_for_python_backend("npu", backend_module=backend_module)
    aten = torch.library.Library("aten", "IMPL")
    # Factories have no tensor argument to dispatch on, so they reach the PrivateUse1 kernels directly.
    aten.impl("empty.memory_format", _empty, "PrivateUse1")
    aten.impl("empty_strided", _empty_strided, "PrivateUse1")
    # The real package registers autocast casting rules for its device; the fake lets autocast pass through,
    # so torch.autocast("npu") runs (ops keep their input dtypes).
    every_op = torch.library.Library("_", "IMPL")
    every_op.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    _libraries.extend((aten, every_op))
    _NpuFactories().__enter__()  # for the life of the process, like the device itself
