"""For the same weights, our lm_eval adapter (TitanLM over the DCP checkpoint) and lm_eval's own Hugging Face
backend (HFLM over the `titan-npu export --format hf` directory) give the same per-request log-likelihoods (fp32,
max abs diff <= 1e-4) and the same accuracy: a dense and a MoE family, on the shipped tasks; greedy generate_until
gives the same text."""

from __future__ import annotations

import pytest
from eval_checkpoints import BOS, EOS, tiny_checkpoint

pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

LIMIT = 12  # questions of titan_mc (48 requests), documents of titan_corpus (several windows each at 64 tokens)


def _hflm(export):
    from lm_eval.models.huggingface import HFLM

    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(export / "tokenizer.json"), bos_token=BOS,
                                                     eos_token=EOS)
    return HFLM(pretrained=str(export), tokenizer=tokenizer, dtype="float32", device="cpu", batch_size=4)


def _requests(loaded, name):
    task = loaded["tasks"][name]
    task.build_all_requests(limit=LIMIT, rank=0, world_size=1)
    return task.instances


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_adapter_and_hflm_give_the_same_loglikelihoods_and_accuracy(tmp_path, family, one_thread):
    from lm_eval.api.instance import Instance

    from titan_npu.cli import main
    from titan_npu.commands.eval import load_checkpoint_model
    from titan_npu.eval.adapter import TitanLM
    from titan_npu.eval.harness import load_tasks, run_tasks, summarize

    ckpt = tiny_checkpoint(tmp_path, family)
    assert main(["export", "--checkpoint", str(ckpt), "--format", "hf", "--dtype", "fp32", "--tokenizer",
                 str(tmp_path / "tokenizer.json"),
                 "--output", str(tmp_path / "hf")]) == 0
    model, tokenizer, _, _ = load_checkpoint_model(ckpt, None, None, "fp32")
    ours, theirs = TitanLM(model, tokenizer, batch_size=4), _hflm(tmp_path / "hf")

    loaded = load_tasks(["titan_mc", "titan_corpus"])
    mc = _requests(loaded, "titan_mc")
    a, b = ours.loglikelihood(mc), theirs.loglikelihood(mc)
    assert len(a) == len(b) == 4 * LIMIT
    assert max(abs(x[0] - y[0]) for x, y in zip(a, b)) <= 1e-4
    assert [x[1] for x in a] == [y[1] for y in b]
    docs = _requests(loaded, "titan_corpus")
    a, b = ours.loglikelihood_rolling(docs), theirs.loglikelihood_rolling(docs)
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-4

    prompts = ["Question: What is 2 plus 3?\nAnswer:", "The assert statement"]
    gen = [Instance("generate_until", {}, (p, {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}), i)
           for i, p in enumerate(prompts)]
    assert ours.generate_until(gen) == theirs.generate_until(gen)

    acc = [summarize(run_tasks(lm, load_tasks(["titan_mc"]), LIMIT))["titan_mc"] for lm in (ours, theirs)]
    assert acc[0]["acc"] == acc[1]["acc"] and acc[0]["acc_norm"] == acc[1]["acc_norm"]
