"""[eval] inside a run: every eval.interval steps (and at the last step) the current weights are evaluated on
lm-evaluation-harness tasks, in-process (no checkpoint round trip).

The model's full weights are gathered to rank 0 (a collective every rank joins; FSDP / TP shards are made whole), a
copy of the whole model is built there and lm_eval runs on it alone; the other ranks go on to the next step, where
they wait for rank 0 at the first collective. An evaluation that fails (a task, the harness, memory) is logged in one
line and the run goes on; the tasks themselves are checked when the run starts, so a mistake in [eval] stops it then.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from titan_npu.config.schema import JobConfig
from titan_npu.device import DeviceInfo
from titan_npu.errors import ConfigError

log = logging.getLogger("titan_npu")


class DownstreamEval:
    """lm_eval tasks on the run's current weights, on rank 0, at eval.interval steps and at the last step."""

    def __init__(self, cfg: JobConfig, tokenizer: Any, model_args: Any, device: DeviceInfo, rank: int) -> None:
        e = cfg.eval
        if cfg.parallel.pp_degree > 1:
            raise ConfigError("eval.enable=true is not supported with parallel.pp_degree > 1 yet (the stages hold "
                              "parts of the model); set eval.enable=false and run titan-npu eval on a checkpoint")
        try:
            import lm_eval  # noqa: F401
        except ImportError:
            raise ConfigError("eval.enable=true needs lm-evaluation-harness: pip install 'titan-npu[eval]' (or set "
                              "eval.enable=false)") from None
        from titan_npu.eval.harness import load_tasks

        self.tasks = [t.strip() for t in e.tasks if t.strip()]
        if not self.tasks:
            raise ConfigError("eval.tasks is empty; name lm_eval tasks, e.g. eval.tasks = [\"titan_mc\"]")
        self.num_fewshot = e.num_fewshot if e.num_fewshot >= 0 else None
        # Checked at the start on every rank alike (names, data on disk, few-shot pools): a mistake stops the run now.
        load_tasks(self.tasks, num_fewshot=self.num_fewshot)
        self.interval, self.limit, self.batch_size = e.interval, e.limit or None, e.batch_size
        self.tokenizer, self.model_args, self.device, self.rank = tokenizer, model_args, device, rank
        self.dtype = torch.float32 if device.type == "cpu" or cfg.training.dtype == "fp32" else torch.bfloat16

    def due(self, step: int, max_steps: int) -> bool:
        """Whether `step` ends with an evaluation."""
        return step % self.interval == 0 or step == max_steps

    def run(self, model_parts: list[nn.Module], step: int) -> dict[str, Any] | None:
        """The record of an evaluation at `step` (on rank 0; None elsewhere, and when it failed: said in one line)."""
        t0 = time.perf_counter()
        try:
            summary = self._evaluate(model_parts)
        except Exception as e:  # noqa: BLE001 - an evaluation never stops training
            if self.rank == 0:
                first = (str(e).strip().splitlines() or [""])[0][:300]
                log.warning("[Eval %d] evaluation failed (%s: %s); training continues", step, type(e).__name__, first)
            return None
        if summary is None:
            return None
        record: dict[str, Any] = {"step": step, "eval_time_s": time.perf_counter() - t0}
        for task, metrics in summary.items():
            record.update({f"eval/{task}/{metric}": value for metric, value in metrics.items()})
        return record

    def _evaluate(self, model_parts: list[nn.Module]) -> dict[str, dict[str, float]] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from titan_npu.checkpoint.fit import load_model
        from titan_npu.eval.adapter import TitanLM
        from titan_npu.eval.harness import load_tasks, run_tasks, summarize

        # Every rank joins the gather (FSDP/TP shards made whole, on rank 0's CPU); rank 0 alone evaluates.
        state = get_model_state_dict(model_parts[0], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        model = load_model(state, self.model_args, self.device.torch_device, self.dtype)
        del state
        lm = TitanLM(model, self.tokenizer, batch_size=self.batch_size, distributed=False)
        try:
            return summarize(run_tasks(lm, load_tasks(self.tasks, num_fewshot=self.num_fewshot), self.limit))
        finally:
            del lm, model

