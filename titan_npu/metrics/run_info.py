"""run_info.json: what a run's report needs to know that metrics.jsonl does not say (model, layout, device),
written by the trainer at start-up and read by the report."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from titan_npu.atomic import atomic_write_json
from titan_npu.regular_files import read_regular_text

RUN_INFO = "run_info.json"


def write_run_info(log_dir: str | os.PathLike, info: dict[str, Any]) -> Path:
    """Save what the report needs to know about the run that metrics.jsonl does not say (model, layout, device)."""
    path = Path(log_dir) / RUN_INFO
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = dict(info, written_at=time.strftime("%Y-%m-%d %H:%M:%S"))
    atomic_write_json(path, payload, indent=2, default=str)
    return path


def run_info(model_args: Any, layout: str, device: Any, world_size: int, tokens_per_step: int,
             flops_per_token: float, peak_flops: float, checkpoint_dir: str | os.PathLike,
             conversations: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """The run_info.json fields from the trainer's objects (the model's args, DeviceInfo); `conversations`: what
    packing did to each chat source (conversations, windows, truncated, dropped), left out for text."""
    a = model_args
    info = {
        "params": a.num_params(),
        "non_embedding_params": a.num_params(exclude_embedding=True),
        "shape": f"dim {a.dim}, {a.n_layers} layers, {a.n_heads}/{a.n_kv_heads} heads, ffn {a.ffn_dim}, "
                 f"vocab {a.vocab_size}",
        "layout": layout,
        "device": f"{world_size} x {device.type} ({device.name}, backend {device.backend})",
        "world_size": world_size,
        "tokens_per_step": tokens_per_step,
        "flops_per_token": flops_per_token,
        "peak_tflops": peak_flops / 1e12,
        "checkpoint_dir": str(Path(checkpoint_dir).resolve()),
    }
    if conversations:
        info["conversations"] = conversations
    return info


def read_run_info(log_dir: str | os.PathLike) -> dict[str, Any]:
    """<log_dir>/run_info.json as a dict; {} when it is missing or unreadable (the report then says less)."""
    try:
        data = json.loads(read_regular_text(Path(log_dir) / RUN_INFO))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
