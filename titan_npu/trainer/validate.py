"""Validation: loss and perplexity on held-out data, over the same batches every time so that runs compare."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titan_npu.config.mixture import sources_of
from titan_npu.config.schema import JobConfig
from titan_npu.device import DeviceInfo
from titan_npu.errors import ConfigError
from titan_npu.metrics.meter import perplexity
from titan_npu.parallel.context_parallel import ContextParallelBatch

IGNORE_INDEX = -100  # labels the loss skips (F.cross_entropy's default)


class Validator:
    """Every validation.interval steps (and at the last step): mean token loss over validation.steps batches.

    The batches come from build_dataloader(split="validation"): validation.data when set, else the held-out
    data.val_fraction of data.path, or of each source of a mixture separately (val_loss/<name>; val_loss is then
    their mean at the mixture's weights). Every rank runs it (the result is reduced over the ranks that hold different
    tokens: data-parallel, and context-parallel ones, which keep their chunks of each sequence by cp_batch).
    """

    def __init__(
        self,
        cfg: JobConfig,
        tokenizer: Any,
        dp_rank: int,
        dp_degree: int,
        device: DeviceInfo,
        model_vocab_size: int,
        process_group: dist.ProcessGroup | None = None,
        cp_batch: ContextParallelBatch | None = None,
    ) -> None:
        from titan_npu.data import build_dataloader

        if cfg.parallel.pp_degree > 1:
            raise ConfigError("validation.enable=true is not supported with parallel.pp_degree > 1 yet; "
                              "set validation.enable=false or pp_degree=1")
        self.interval = cfg.validation.interval
        self.steps = cfg.validation.steps
        self.device = device
        self.process_group = process_group
        self.cp_batch = cp_batch
        # A mixture without validation.data: each source's held-out split on its own (val_loss/<name>).
        sources = sources_of(cfg.data)
        names: list[str | None] = [s.name for s in sources] if len(sources) > 1 and not cfg.validation.data \
            else [None]
        self.weights = {s.name: s.weight for s in sources}
        self.loaders = {name: build_dataloader(cfg, tokenizer, dp_rank, dp_degree, split="validation",
                                               device_type=device.type, model_vocab_size=model_vocab_size,
                                               source=name) for name in names}
        self._starts = {name: loader.state_dict() for name, loader in self.loaders.items()}

    def due(self, step: int, max_steps: int) -> bool:
        """Whether `step` ends with a validation."""
        return step % self.interval == 0 or step == max_steps

    @torch.no_grad()
    def run(self, model: nn.Module, step: int,
            autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
            loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
            ) -> dict[str, Any]:
        """Evaluate `model` (left in train mode afterwards); a metrics record with val_loss and val_ppl.

        `loss_context` is the training loss's context: torch's loss_parallel when TP leaves the logits sharded
        by vocabulary, so the loss is computed on the shards as in training.
        """
        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        sums = []
        try:
            for name, loader in self.loaders.items():
                loader.load_state_dict(self._starts[name])
                try:
                    sums += self._evaluate(model, loader, autocast, loss_context)
                finally:
                    loader.close()  # no prefetch workers idle until the next validation
        finally:
            model.train(was_training)
        totals = torch.stack(sums)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.process_group)
        values = totals.tolist()
        record: dict[str, Any] = {"step": step}
        if None in self.loaders:
            loss_total, tokens = values
            val_loss = loss_total / tokens if tokens > 0 else math.nan
        else:  # the mixture's loss: each source's mean token loss at its weight
            per_source = {name: values[2 * i] / values[2 * i + 1] if values[2 * i + 1] > 0 else math.nan
                          for i, name in enumerate(self.loaders)}
            val_loss = sum(self.weights[name] * loss for name, loss in per_source.items())
            tokens = sum(values[1::2])
            for name, loss in per_source.items():
                record[f"val_loss/{name}"] = loss
                record[f"val_ppl/{name}"] = perplexity(loss)
        record.update({
            "val_loss": val_loss,
            "val_ppl": perplexity(val_loss),
            "val_batches": self.steps * len(self.loaders),
            "val_tokens": int(tokens),
            "val_time_s": time.perf_counter() - t0,
        })
        return record

    def _evaluate(self, model: nn.Module, loader: Any, autocast: Callable, loss_context: Callable,
                  ) -> list[torch.Tensor]:
        """[loss summed over the tokens, tokens] of validation.steps batches of one loader, on this rank."""
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device.torch_device)
        count = torch.zeros((), dtype=torch.float32, device=self.device.torch_device)
        for _ in range(self.steps):
            inputs, labels, *documents = next(loader)  # documents: with data.document_mask
            inputs = inputs.to(self.device.torch_device, non_blocking=True)
            labels = labels.to(self.device.torch_device, non_blocking=True)
            device = self.device.torch_device
            kwargs = {"documents": documents[0].to(device, non_blocking=True)} if documents else {}
            if self.cp_batch is not None:
                inputs, labels = self.cp_batch.split(inputs, labels)
            with autocast():
                logits = model(inputs, **kwargs)
            with loss_context():
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                                       ignore_index=IGNORE_INDEX)
            loss_sum += loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            count += (labels != IGNORE_INDEX).sum()
        return [loss_sum, count]
