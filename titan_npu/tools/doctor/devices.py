"""The devices this process would train on: type, count, memory, and whether torchrun starts too many ranks."""

from __future__ import annotations

import os

from titan_npu.tools.doctor.report import Report


def check_devices(report: Report) -> dict:
    """Which device type this process would train on, how many are visible, and their memory."""
    from titan_npu.device import detect_device_type, device_module
    from titan_npu.errors import DeviceError

    s = "devices"
    try:
        device_type = detect_device_type()
    except DeviceError as e:
        report.add("fail", s, str(e))
        return {"type": None, "count": 0}
    facts: dict = {"type": device_type, "count": 0, "names": []}
    mod = device_module(device_type)
    visible_var = "ASCEND_RT_VISIBLE_DEVICES" if device_type == "npu" else "CUDA_VISIBLE_DEVICES"
    if mod is None:
        report.add("info", s, f"no accelerator: training runs on cpu ({os.cpu_count()} cores, gloo backend)")
        return facts
    count = mod.device_count()
    facts["count"] = count
    for i in range(count):
        try:
            props = mod.get_device_properties(i)
            facts["names"].append(f"{mod.get_device_name(i)} ({props.total_memory / 1024**3:.0f} GiB)")
        except Exception:
            facts["names"].append(device_type)
    visible = os.environ.get(visible_var)
    report.add("ok" if count else "fail", s, f"{count} {device_type} device(s): {', '.join(facts['names']) or '-'}"
               f" ({visible_var}={visible if visible is not None else '<unset>'})")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world > count:
        report.add("fail", s, f"torchrun starts {local_world} processes on this node but only {count} {device_type} "
                              f"device(s) are visible; lower --nproc_per_node or widen {visible_var}")
    return facts
