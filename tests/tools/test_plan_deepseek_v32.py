"""The planner's terms for DeepSeek-V3.2: the indexer's parameters (in the family's parameter table and counts, as
transformers builds them), its FLOPs and attention's over the top-k keys against a hand count, its activation bytes,
and the layouts DSA refuses left out of the search."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from titan_npu.config.loader import load_config
from titan_npu.config.schema import ModelConfig
from titan_npu.errors import LayoutError
from titan_npu.models.deepseek_v3.cost import mla_attention_bytes
from titan_npu.models.deepseek_v32.cost import dsa_attention_bytes
from titan_npu.models.registry import build_model, build_model_args, get_spec
from titan_npu.parallel.degrees import Degrees
from titan_npu.planner.activations import cost_site
from titan_npu.planner.hardware import hardware
from titan_npu.planner.layout import Layout, job_from_config
from titan_npu.planner.perf import training_flops_per_token
from titan_npu.planner.search import check_layout, config_for_layout, make_plan

DEBUG = Path(__file__).resolve().parents[2] / "configs" / "debug_deepseek_v32.toml"
TINY = ["--training.seq_len", "64", "--training.batch_size", "2"]


def test_the_parameter_table_and_counts_hold_each_layers_indexer():
    args = build_model_args(ModelConfig(name="deepseek_v32", flavor="debug"))
    model = build_model(args)
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    shapes = {name.split(".", 2)[2]: tuple(p.shape) for name, p in model.named_parameters() if ".indexer." in name}
    kinds = get_spec("deepseek_v32").parameter_kinds(args)
    assert shapes == {k: shape for k, (shape, _) in kinds.items() if ".indexer." in k}
    assert shapes["attention.indexer.wq_b.weight"] == (4 * 32, 64) and all(kinds[k][1] is None for k in shapes)
    # Each layer's: wq_b 64 x 128, wk 128 x 32, k_norm 2 x 32, weights_proj 128 x 4.
    assert args.indexer_params() == 64 * 128 + 128 * 32 + 2 * 32 + 128 * 4
    assert 4 * args.indexer_params() == sum(p.numel() for n, p in model.named_parameters() if ".indexer." in n)


def test_flops_count_attention_over_the_top_k_keys_and_the_indexers_scoring():
    args = build_model_args(ModelConfig(name="deepseek_v32", flavor="V3.2"))
    active = args.num_active_params(exclude_embedding=True)
    indexer = 6 * 61 * 64 * 128  # per key: the indexer's H_I x D_I products, forward and backward
    for seq, keys in ((1024, 1024), (4096, 2048), (131072, 2048)):
        assert training_flops_per_token(args, seq) == (6 * active + 6 * 61 * 128 * keys * (192 + 128)
                                                       + indexer * seq)
    warmup = dataclasses.replace(args, dsa_stage="dense_warmup")
    assert training_flops_per_token(warmup, 4096) == 6 * active + 6 * 61 * 128 * 4096 * 320 + indexer * 4096


def test_a_learning_indexer_adds_its_fp32_query_key_weights_and_per_key_scores_to_mlas_activations():
    job = job_from_config(load_config(DEBUG, TINY))
    site = cost_site(job, Layout(Degrees()), "cpu")
    assert site.seq_len == 64
    extra = dsa_attention_bytes(job.args, site).saved - mla_attention_bytes(job.args, site).saved
    # fp32 q, k; k's norm input (fp32 run) and stats; w; per key of the 64: 4 heads' scores (5 bytes each), the
    # per-query fp32 key copy (4 x 32) and the KL's 12 bytes.
    assert extra == 4 * 4 * 32 + 4 * 32 + 4 * 32 + 8 + 4 * 4 + 64 * (5 * 4 + 4 * 32 + 12)
    # Its backward's transient: the key copy's and the scores' gradients (4 x 32 + 4 per key), above the KL target's
    # (3 fp32 tensors per head of the model's 4, and 8 bytes).
    assert dsa_attention_bytes(job.args, site).transient == 64 * max(4 * 32 + 4, 12 * 4 + 8)
    frozen = dataclasses.replace(job.args, indexer_loss_weight=0.0)
    assert dsa_attention_bytes(frozen, site).saved == mla_attention_bytes(frozen, site).saved
    assert dsa_attention_bytes(frozen, site).transient == 64 * (4 * 32 + 5 * 4) + 4 * 4 * 32


def test_the_search_leaves_out_what_dsa_refuses():
    cfg = load_config(DEBUG, TINY)
    job = job_from_config(cfg)
    for layout, refusal in [(Layout(Degrees(dp_shard=2, tp=2)), "no tensor-parallel plan"),
                            (Layout(Degrees(dp_shard=2, cp=2)), "context parallelism splits"),
                            (Layout(Degrees(dp_shard=2, pp=2), batch_size=4), "across pipeline stages")]:
        with pytest.raises(LayoutError, match=refusal):
            check_layout(config_for_layout(cfg, layout), job, layout.degrees)
    # A top-k that keeps every key of the training sequence in the sparse stage, and GLM-5's shared layers across
    # pipeline stages.
    whole = load_config(DEBUG, ["--training.seq_len", "16", "--training.batch_size", "2"])
    with pytest.raises(LayoutError, match=r"model.index_topk=16 >= training.seq_len=16 in the sparse stage"):
        check_layout(whole, job_from_config(whole), Degrees())
    shared = load_config(DEBUG, [*TINY, "--model.indexer_loss_weight", "0", "--model.variant", "glm_moe_dsa",
                                 "--model.indexer_types", '["full", "shared", "full", "shared"]'])
    layout = Layout(Degrees(dp_shard=2, pp=2), batch_size=4)
    with pytest.raises(LayoutError, match="sharing selections across layers"):
        check_layout(config_for_layout(shared, layout), job_from_config(shared), layout.degrees)
    plan = make_plan(cfg, 1, 4, hardware("910B2"), top=10**6)
    layouts = [c.layout for c in plan.ranked]
    assert layouts and all(lay.tp == 1 and lay.cp == 1 and lay.pp == 1 for lay in layouts)
    assert {2, 4} <= {lay.ep for lay in layouts}


def test_frozen_indexers_pipeline_as_deepseek_v3():
    cfg = load_config(DEBUG, [*TINY, "--model.indexer_loss_weight", "0"])
    layout = Layout(Degrees(dp_shard=2, pp=2), batch_size=4)
    check_layout(config_for_layout(cfg, layout), job_from_config(cfg), layout.degrees)
    assert not any(p.requires_grad for n, p in build_model(job_from_config(cfg).args).named_parameters()
                   if ".indexer." in n)
