"""Activation offload (activation_checkpoint.offload): the tensors that autograd saves inside the blocks activation
checkpointing does not recompute go to pinned host memory during forward and come back before their backward.

Built on torch's saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks, the mechanism of
torch.autograd.graph.save_on_cpu), entered around each such block's forward by module hooks, so that the block
keeps its state-dict names and composes with FSDP2, tensor parallelism and the pipeline schedules (which call the
block's forward and run its backward wherever they do). On npu/cuda the copies run on a side stream: a saved tensor
is copied out as soon as it is saved (its device memory returns to the allocator once the copy is done), and the
first tensor a block's backward asks for brings back that block's tensors and those of the block before it in the
same forward (Megatron's and MindSpeed's prefetch-one-ahead), so the next backward finds them on the device.
A recomputed block keeps nothing to move (torch's checkpoint holds its saves in its own hooks); parameters, their
views, DTensors and tensors under offload_min_bytes stay where they are.
On cpu the "host" is the device itself: the same hooks copy within host memory (bit-identical results, no memory
saved: the trainer warns once), which is how the tests hold the mechanism to a run without it.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_npu.parallel.activation_checkpoint import blocks_to_checkpoint

if TYPE_CHECKING:
    from titan_npu.config.schema import ActivationCheckpointConfig


class _Packed:
    """One tensor moved to host (a saved tensor's base: its views share it): its host copy, the device it came
    from, and its copy back once started."""

    __slots__ = ("host", "device", "copied", "back", "ready", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, copied: Any) -> None:
        self.host, self.device, self.copied = host, device, copied
        self.back: torch.Tensor | None = None
        self.ready: Any = None


class _View:
    """A saved tensor as a view of a moved (contiguous) copy: its size, strides and offset in it."""

    __slots__ = ("base", "size", "stride", "offset")

    def __init__(self, base: _Packed, size: torch.Size, stride: tuple[int, ...], offset: int) -> None:
        self.base, self.size, self.stride, self.offset = base, size, stride, offset


class _BlockPass:
    """The tensors one forward of one block moved to host (weakly: autograd owns them) and the pass before it."""

    def __init__(self, order: int, previous: _BlockPass | None) -> None:
        self.order = order
        self.previous = weakref.ref(previous) if previous is not None else None
        self.packed: list[weakref.ref[_Packed]] = []
        self.fetched = False


class ActivationOffload:
    """The hooks of one model part: what they moved (moved_bytes and moved_tensors, which the tests and
    benchmarks/memory_tools.py read) and the side stream of each accelerator."""

    def __init__(self, min_bytes: int, model: nn.Module | None = None) -> None:
        self.min_bytes = min_bytes
        # The model whose buffers (RoPE tables, shared by every block) stay: moving them would free nothing.
        self._model = weakref.ref(model) if model is not None else None
        self._buffers: set[int] = set()
        self.moved_bytes = 0  # bytes copied to host so far
        self.moved_tensors = 0
        self.blocks = 0  # blocks whose forward the hooks wrap
        self._last: _BlockPass | None = None
        self._streams: dict[torch.device, Any] = {}
        # id of a base moved in the current block's forward -> (the base, weakly; its _Packed, weakly): the views
        # autograd saves of one tensor (each projection's input, a reshape of the same activation) move once.
        self._moved: dict[int, tuple[weakref.ref, weakref.ref]] = {}

    def install(self, block: nn.Module, order: int) -> None:
        """Offload what `block` saves in each forward (`order`: its position among the part's blocks)."""
        contexts: list[torch.autograd.graph.saved_tensors_hooks] = []

        def enter(module: nn.Module, args: Any) -> None:
            model = self._model() if self._model is not None else None
            self._buffers = {id(b) for b in model.buffers()} if model is not None else set()
            current = _BlockPass(order, self._last)
            self._last = current
            self._moved = {}  # what one block's forward saves shares bases within it
            hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(current, t),
                                                             lambda p: self._unpack(current, p))
            hooks.__enter__()
            contexts.append(hooks)

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            contexts.pop().__exit__(None, None, None)

        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave, always_call=True)
        self.blocks += 1

    def _keeps(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` stays where it is: a parameter, a buffer or a view of one, a DTensor, or a small
        tensor."""
        base = tensor._base if tensor._base is not None else tensor
        if isinstance(tensor, DTensor) or isinstance(base, nn.Parameter) or id(base) in self._buffers:
            return True
        return tensor.numel() * tensor.element_size() < self.min_bytes

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            module = getattr(torch, device.type)
            with module.device(device):
                self._streams[device] = module.Stream()
        return self._streams[device]

    def _pack(self, current: _BlockPass, tensor: torch.Tensor) -> Any:
        if self._keeps(tensor):
            return tensor
        base = tensor._base if tensor._base is not None else tensor
        if base.dtype != tensor.dtype or not base.is_contiguous():
            base = tensor  # a view of another dtype, or a base whose copy would not keep the strides: copy the view
        entry = self._moved.get(id(base))
        packed = entry[1]() if entry is not None and entry[0]() is base else None
        if packed is None:
            packed = self._move(base)
            current.packed.append(weakref.ref(packed))
            self._moved[id(base)] = (weakref.ref(base), weakref.ref(packed))
        if base is tensor and not tensor.is_contiguous():
            return _View(packed, tensor.size(), packed.host.stride(), 0)
        return _View(packed, tensor.size(), tensor.stride(), tensor.storage_offset() - base.storage_offset())

    def _move(self, tensor: torch.Tensor) -> _Packed:
        """Start copying `tensor` to host (on cpu: a copy in the same memory)."""
        device = tensor.device
        if device.type == "cpu":
            packed = _Packed(torch.empty(tensor.size(), dtype=tensor.dtype).copy_(tensor), device, None)
        else:
            module = getattr(torch, device.type)
            stream, main = self._stream(device), module.current_stream(device)
            host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=True)
            stream.wait_stream(main)  # the tensor is computed
            with module.stream(stream):
                host.copy_(tensor, non_blocking=True)
                copied = stream.record_event()
            tensor.record_stream(stream)  # its memory is reused only after the copy
            packed = _Packed(host, device, copied)
        self.moved_bytes += tensor.numel() * tensor.element_size()
        self.moved_tensors += 1
        return packed

    def _unpack(self, current: _BlockPass, view: Any) -> torch.Tensor:
        if not isinstance(view, _View):
            return view
        if not current.fetched:  # the block's backward begins: its tensors and the previous block's come back
            current.fetched = True
            self._fetch(current)
            previous = current.previous() if current.previous is not None else None
            if previous is not None and previous.order < current.order and not previous.fetched:
                previous.fetched = True
                self._fetch(previous)
        return self._take(view.base).as_strided(view.size, view.stride, view.offset)

    def _fetch(self, block_pass: _BlockPass) -> None:
        """Start copying back every tensor of `block_pass` still held by autograd (on the side stream)."""
        for ref in block_pass.packed:
            packed = ref()
            if packed is not None and packed.back is None:
                self._copy_back(packed)

    def _copy_back(self, packed: _Packed) -> None:
        if packed.device.type == "cpu":
            packed.back = packed.host
            return
        module = getattr(torch, packed.device.type)
        stream = self._stream(packed.device)
        with module.stream(stream):
            stream.wait_event(packed.copied)
            packed.back = torch.empty_like(packed.host, device=packed.device)
            packed.back.copy_(packed.host, non_blocking=True)
            packed.ready = stream.record_event()

    def _take(self, packed: _Packed) -> torch.Tensor:
        """The tensor on its device, once its copy back is done (waited for on the device, not the host)."""
        if packed.back is None:
            self._copy_back(packed)
        back = packed.back
        if packed.ready is not None:
            main = getattr(torch, packed.device.type).current_stream(packed.device)
            main.wait_event(packed.ready)
            back.record_stream(main)
        return back


def apply_activation_offload(model: nn.Module, cfg: ActivationCheckpointConfig) -> ActivationOffload | None:
    """Install the offload hooks on the blocks of model.layers that activation checkpointing does not recompute
    (activation_checkpoint.offload); the hooks' object is also model.activation_offload."""
    if not cfg.offload:
        return None
    present = [i for i, block in model.layers.items() if block is not None]
    recomputed = set(blocks_to_checkpoint(present, cfg))
    offload = ActivationOffload(cfg.offload_min_bytes, model)
    for order, layer_id in enumerate(present):
        if layer_id not in recomputed:
            offload.install(model.layers[layer_id], order)
    model.activation_offload = offload
    return offload
