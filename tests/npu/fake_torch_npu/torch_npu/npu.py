"""The `torch.npu` device namespace of the fake: enough of torch_npu.npu for detection, binding and memory stats.

The device count honours ASCEND_RT_VISIBLE_DEVICES like the real runtime; FAKE_NPU_COUNT (default 8) is the number
of cards in the machine and FAKE_NPU_NAME (default Ascend910B3) what get_device_name reports. What the code under
test asked of the device (set_device, memory fraction, empty_cache) is recorded in `state`.
"""

from __future__ import annotations

import os

GB = 1024**3

state: dict = {}


def _reset_state() -> None:
    """Forget what earlier calls recorded."""
    state.clear()
    state.update(current_device=0, set_device_calls=[], memory_fraction={}, empty_cache_calls=0, synchronize_calls=0,
                 peak_resets=0)


_reset_state()


def _machine_count() -> int:
    return int(os.environ.get("FAKE_NPU_COUNT", "8"))


def is_available() -> bool:
    return device_count() > 0


def device_count() -> int:
    # The cards of ASCEND_RT_VISIBLE_DEVICES, a comma list of ids (torch_npu/npu/__init__.py:418-443,
    # _parse_visible_devices; unset = every card); ids the machine lacks are not counted.
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if visible is None:
        return _machine_count()
    ids = [int(i) for i in visible.split(",") if i.strip()]
    return len([i for i in ids if i < _machine_count()])


def _check_index(device) -> int:
    index = device if isinstance(device, int) else getattr(device, "index", None)
    index = state["current_device"] if index is None else int(index)
    if not 0 <= index < device_count():
        raise RuntimeError(f"npu: invalid device index {index} (device_count={device_count()})")
    return index


def set_device(device) -> None:
    import torch_npu

    torch_npu._record_event("set_device")  # the caching allocator reads its configuration when the device starts
    index = _check_index(device)
    state["current_device"] = index
    state["set_device_calls"].append(index)


def current_device() -> int:
    return state["current_device"]


def synchronize(device=None) -> None:
    state["synchronize_calls"] += 1


def get_device_name(device=None) -> str:
    _check_index(device if device is not None else state["current_device"])
    return os.environ.get("FAKE_NPU_NAME", "Ascend910B3")


class _Properties:
    def __init__(self, name: str, total_memory: int) -> None:
        self.name = name
        self.total_memory = total_memory


def get_device_properties(device=None) -> _Properties:
    return _Properties(get_device_name(device), 64 * GB)


def memory_allocated(device=None) -> int:
    return 0


def memory_reserved(device=None) -> int:
    return 0


def max_memory_allocated(device=None) -> int:
    return 0


def max_memory_reserved(device=None) -> int:
    return 0


def reset_peak_memory_stats(device=None) -> None:
    state["peak_resets"] += 1


def empty_cache() -> None:
    state["empty_cache_calls"] += 1


def set_per_process_memory_fraction(fraction: float, device=None) -> None:
    if not 0 < fraction <= 1:
        raise ValueError(f"invalid memory fraction {fraction}")
    state["memory_fraction"][_check_index(device)] = fraction


def is_bf16_supported() -> bool:
    return True


def manual_seed(seed: int) -> None:
    pass


# What torch asks of a registered device module (torch._register_device_module) besides the above.
def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def get_amp_supported_dtype() -> list:
    import torch

    return [torch.float16, torch.bfloat16]


def manual_seed_all(seed: int) -> None:
    pass


class Event:
    """torch_npu.npu.Event: work is done when issued on the fake, so every event has happened."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        pass

    def record(self, stream: Stream | None = None) -> None:
        pass

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class Stream:
    """torch_npu.npu.Stream: CPU work is done when issued, so waiting is immediate."""

    def __init__(self, device=None, priority: int = 0) -> None:
        self.device = device

    def synchronize(self) -> None:
        state["synchronize_calls"] += 1

    def wait_stream(self, stream: Stream) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def record_event(self, event: Event | None = None) -> Event:
        return event or Event()

    def query(self) -> bool:
        return True


_current_stream = Stream()


def current_stream(device=None) -> Stream:
    return _current_stream


def stream(stream_: Stream | None):
    """A context in which `stream_` is current (the fake has one stream, so nothing changes)."""
    import contextlib

    return contextlib.nullcontext()
