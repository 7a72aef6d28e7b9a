"""An lm-evaluation-harness model over a titan_npu model: lm_eval's `LM` interface (loglikelihood,
loglikelihood_rolling, generate_until) answered by our own forward and the run's tokenizer, batched.

Scoring follows lm_eval's HF backend (HFLM) step for step, so that the same weights give the same numbers through
either (tests/eval/test_eval_parity.py): the context/continuation split is TemplateLM's, a too-long request keeps its
last max_length + 1 tokens, an empty context is the prefix token (BOS, else EOS), rolling windows are
lm_eval.utils.get_rolling_token_windows. Under torch.distributed the requests are split over the ranks by lm_eval
(data parallel: every rank holds the whole model); a single process has rank 0 of 1.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from torch import nn

from titan_npu.data.tokenizer import Tokenizer

DEFAULT_MAX_GEN_TOKS = 256


class TitanLM(TemplateLM):
    """lm_eval's LM over `model` (a whole titan_npu model, in eval mode, on its device) and the run's tokenizer."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, batch_size: int = 1,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, distributed: bool = True) -> None:
        """distributed: split the requests over torch.distributed's ranks when a process group is up (False: this
        process evaluates alone, as rank 0 of a run does)."""
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self.max_length = int(model.args.max_seq_len)
        self.vocab = model.output.out_features
        self._device = model.tok_embeddings.weight.device
        if distributed and torch.distributed.is_available() and torch.distributed.is_initialized():
            self._rank, self._world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()

    # ------------------------------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        """End of text: the tokenizer's EOS (else its BOS)."""
        eos = self.tokenizer.eos_id if self.tokenizer.eos_id is not None else self.tokenizer.bos_id
        if eos is None:
            raise ValueError(f"{self.tokenizer!r} has neither EOS nor BOS; lm_eval needs an end-of-text token")
        return eos

    @property
    def prefix_token_id(self) -> int:
        """What stands before a continuation with no context: BOS, else EOS (as HFLM)."""
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's fingerprint (lm_eval keys its request caches by it)."""
        return f"titan-{self.tokenizer.fingerprint()}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of `string`, without BOS/EOS (HFLM's default for a causal model)."""
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        """Text of token ids."""
        return self.tokenizer.decode(tokens)

    # ------------------------------------------------------------------------------------------ scoring
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """TemplateLM's loglikelihood without its tokenizing progress bar (titan-npu prints a line per task)."""
        return super().loglikelihood(requests, disable_tqdm=True)

    @torch.no_grad()
    def _logprobs(self, rows: list[list[int]]) -> torch.Tensor:
        """Log-softmax over the vocabulary [B, S_max, V] (fp32) of right-padded token rows, in one forward."""
        longest = max(len(r) for r in rows)
        batch = torch.full((len(rows), longest), self.eot_token_id, dtype=torch.long)
        for i, r in enumerate(rows):
            batch[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        logits = self.model(batch.to(self._device))  # causal: padding after a row changes none of its positions
        return torch.log_softmax(logits.float(), dim=-1)

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation) per request."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            rows, conts = [], []
            for i in chunk:
                _, context, continuation = requests[i]
                rows.append((context + continuation)[-(self.max_length + 1):][:-1])
                conts.append(continuation)
            logprobs = self._logprobs(rows)
            for b, (i, row, cont) in enumerate(zip(chunk, rows, conts)):
                picked = logprobs[b, len(row) - len(cont): len(row)]  # the positions that predict the continuation
                target = torch.tensor(cont, dtype=torch.long, device=picked.device)
                greedy = bool((picked.argmax(dim=-1) == target).all())
                answer = (float(picked.gather(-1, target[:, None]).sum()), greedy)
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents, scored in disjoint windows of max_length tokens (as HFLM)."""
        windows: list[tuple[None, list[int], list[int]]] = []
        owners: list[int] = []
        for n, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(n)
        totals = [0.0] * len(requests)
        for n, (ll, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[n] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context until one of its `until` strings or max_gen_toks tokens."""
        out = []
        for req in requests:
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            eos_text = self.tok_decode([self.eot_token_id])
            if eos_text and eos_text not in until:
                until.append(eos_text)
            budget = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            room = max(self.max_length - budget, 1)
            ids = self.tok_encode(context)[-room:] or [self.prefix_token_id]
            new: list[int] = []
            text = ""
            for _ in range(budget):
                row = (ids + new)[-self.max_length:]
                nxt = int(self._logprobs([row])[0, len(row) - 1, : self.tokenizer.vocab_size].argmax())
                if nxt == self.eot_token_id:
                    break
                new.append(nxt)
                text = self.tok_decode(new)
                if any(stop in text for stop in until):
                    break
            for stop in until:
                text = text.split(stop)[0] if stop else text
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out

    # ------------------------------------------------------------------------------------------ ranks
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`, concatenated (lm_eval pads the ranks' request lists with it)."""
        if self.world_size == 1:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's `obj` on rank `dst` (None elsewhere)."""
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.world_size > 1:
            torch.distributed.barrier()
