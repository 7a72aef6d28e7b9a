"""The configs/ folder: every file loads, says how many cards and how to launch, and means what its name says."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_npu.config.aliases import KEY_ALIASES, SECTION_ALIASES, SUBSECTION_ALIASES, TOP_LEVEL_ALIASES
from titan_npu.config.coerce import field_types, section_types
from titan_npu.config.loader import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DOCS = CONFIGS.parent / "docs" / "config.md"

EXPECTED = {
    "debug.toml": ("llama3", "debug"),
    "debug_moe.toml": ("qwen3_moe", "debug"),
    "debug_deepseek.toml": ("deepseek_v3", "debug"),
    "llama2_7b.toml": ("llama2", "7B"),
    "llama2_13b.toml": ("llama2", "13B"),
    "llama2_70b.toml": ("llama2", "70B"),
    "llama3_1b.toml": ("llama3", "1B"),
    "llama3_8b.toml": ("llama3", "8B"),
    "llama3_70b.toml": ("llama3", "70B"),
    "llama_7b.toml": ("llama2", "7B"),
    "llama_13b.toml": ("llama2", "13B"),
    "llama_70b.toml": ("llama2", "70B"),
    "llama3_7b.yaml": ("llama3", "7B"),
    "qwen3_32b.toml": ("qwen3", "32B"),
    "qwen3_8b.toml": ("qwen3", "8B"),
    "qwen2_7b.toml": ("qwen2", "7B"),
    "qwen3_32b.yaml": ("qwen3", "32B"),
    "qwen3_30b_a3b.toml": ("qwen3_moe", "30B-A3B"),
    "qwen3_235b_a22b.toml": ("qwen3_moe", "235B-A22B"),
    "llama3_8b_128k.toml": ("llama3", "3.1-8B"),
    "deepseek_v3_16b.toml": ("deepseek_v3", "16B"),
    "deepseek_v3_671b.toml": ("deepseek_v3", "671B"),
    "debug_gpt_oss.toml": ("gpt_oss", "debug"),
    "debug_qwen3_next.toml": ("qwen3_next", "debug"),
    "debug_qwen3_5.toml": ("qwen3_next", "debug-dense"),
    "gpt_oss_20b.toml": ("gpt_oss", "20B"),
    "gpt_oss_120b.toml": ("gpt_oss", "120B"),
    "qwen3_5_9b.toml": ("qwen3_next", "3.5-9B"),
    "qwen3_next_80b_a3b.toml": ("qwen3_next", "80B-A3B"),
    "qwen3_8b_sft.toml": ("qwen3", "8B"),
    "sft_debug.toml": ("llama3", "debug"),
}
# The cards a Qwen config's header names (nodes, 910B per node) and a rank whose dry run is checked.
QWEN_CLUSTERS = {"qwen3_32b.toml": (2, 8, 6), "qwen3_8b.toml": (1, 8, 7), "qwen2_7b.toml": (1, 4, 3),
                 "qwen3_8b_sft.toml": (1, 8, 5)}


def test_every_config_loads_and_names_cards_and_launch(config_files):
    for path in config_files:
        cfg = load_config(path)
        header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
        assert "Cards:" in header and "Launch:" in header, f"{path.name}: header lacks Cards:/Launch:"
        assert path.name in header, f"{path.name}: launch command does not name the file"
        assert cfg.training.seq_len <= (cfg.model.max_seq_len or cfg.training.seq_len), path.name


@pytest.mark.parametrize(("name", "model"), EXPECTED.items())
def test_named_configs_exist_and_select_their_model(name, model):
    cfg = load_config(CONFIGS / name)
    assert (cfg.model.name, cfg.model.flavor) == model


@pytest.mark.parametrize("name", list(QWEN_CLUSTERS))
def test_qwen_configs_hold_the_planners_first_layout_and_dry_run_to_its_bytes(name):
    from titan_npu.planner.dry_run import dry_run
    from titan_npu.planner.hardware import hardware
    from titan_npu.planner.search import make_plan
    from titan_npu.planner.verify import compare_with_plan

    nodes, per_node, rank = QWEN_CLUSTERS[name]
    cfg = load_config(CONFIGS / name)
    plan = make_plan(cfg, nodes, per_node, hardware("910B2"))
    assert plan.config_candidate is not None and plan.config_candidate.fits, plan.config_error
    assert plan.ranked[0].layout == plan.config_candidate.layout
    comparison = compare_with_plan(dry_run(cfg, nodes * per_node, rank), cfg)
    assert comparison["match"], comparison["problems"]


# The cards a MoE config's header names (nodes, 910B per node), a rank whose dry run is checked, and its ep degree.
MOE_CLUSTERS = {"qwen3_30b_a3b.toml": (1, 8, 7, 1), "qwen3_235b_a22b.toml": (16, 8, 77, 8),
                "gpt_oss_20b.toml": (1, 8, 7, 4), "qwen3_5_9b.toml": (1, 8, 7, 1)}


# The search over 8 ranks takes seconds, over 128 minutes: the 235B one runs with the slow tests (its fit and dry run
# below run by default).
# Qwen3.5-9B is dense, but its dry run checks shards only too: a forward of fake tensors through the chunked delta
# rule's loop (64 chunks x 24 linear layers) takes minutes (tests/tools/test_plan_qwen3_next.py runs the debug one's).
@pytest.mark.parametrize("name", [pytest.param("qwen3_30b_a3b.toml"), pytest.param("gpt_oss_20b.toml"),
                                  pytest.param("qwen3_5_9b.toml"),
                                  pytest.param("qwen3_235b_a22b.toml", marks=pytest.mark.slow)])
def test_moe_configs_hold_the_planners_first_layout_and_dry_run_to_its_bytes(name):
    from titan_npu.planner.dry_run import dry_run
    from titan_npu.planner.hardware import hardware
    from titan_npu.planner.search import make_plan
    from titan_npu.planner.verify import compare_with_plan

    nodes, per_node, rank, ep = MOE_CLUSTERS[name]
    cfg = load_config(CONFIGS / name)
    assert cfg.parallel.ep_degree == ep
    plan = make_plan(cfg, nodes, per_node, hardware("910B2"))
    assert plan.config_candidate is not None and plan.config_candidate.fits, plan.config_error
    assert plan.ranked[0].layout == plan.config_candidate.layout
    # Shards only (no forward): tests/tools/test_plan_moe.py runs forward/backward under expert parallelism.
    comparison = compare_with_plan(dry_run(cfg, nodes * per_node, rank, forward=False), cfg)
    assert comparison["match"], comparison["problems"]


# The large MoE configs: (nodes, 910B per node) of the header, a rank whose dry run is checked, (ep, dp_replicate).
DEEPSEEK_CLUSTERS = {"deepseek_v3_16b.toml": (1, 8, 7, (8, 1)), "deepseek_v3_671b.toml": (64, 8, 77, (64, 1))}
FIT_CLUSTERS = {**DEEPSEEK_CLUSTERS, "qwen3_235b_a22b.toml": (16, 8, 77, (8, 1)),
                "gpt_oss_120b.toml": (8, 8, 63, (8, 1)), "qwen3_next_80b_a3b.toml": (4, 8, 31, (8, 4))}


@pytest.mark.parametrize("name", list(FIT_CLUSTERS))
def test_large_moe_configs_fit_and_dry_run_to_the_plans_bytes(name):
    from titan_npu.planner.dry_run import dry_run
    from titan_npu.planner.hardware import hardware
    from titan_npu.planner.layout import job_from_config, layout_from_config
    from titan_npu.planner.search import evaluate
    from titan_npu.planner.verify import compare_with_plan

    nodes, per_node, rank, (ep, replicas) = FIT_CLUSTERS[name]
    cfg = load_config(CONFIGS / name)
    layout = layout_from_config(cfg, nodes * per_node)
    assert (layout.ep, layout.dp_replicate) == (ep, replicas)
    assert evaluate(job_from_config(cfg), layout, hardware("910B2"), per_node, 0.4).fits
    comparison = compare_with_plan(dry_run(cfg, nodes * per_node, rank, forward=False), cfg)
    assert comparison["match"], comparison["problems"]


# The search over 8 ranks takes seconds, over 512 minutes: the 671B one runs with the slow tests.
@pytest.mark.parametrize("name", [pytest.param("deepseek_v3_16b.toml"),
                                  pytest.param("deepseek_v3_671b.toml", marks=pytest.mark.slow)])
def test_deepseek_configs_hold_the_planners_first_layout(name):
    from titan_npu.planner.hardware import hardware
    from titan_npu.planner.search import make_plan

    nodes, per_node, _, _ = DEEPSEEK_CLUSTERS[name]
    plan = make_plan(load_config(CONFIGS / name), nodes, per_node, hardware("910B2"))
    assert plan.config_candidate is not None and plan.config_candidate.fits, plan.config_error
    assert plan.ranked[0].layout == plan.config_candidate.layout


@pytest.mark.slow  # a search over 64 ranks: minutes
def test_the_235b_moe_config_is_on_the_smallest_cluster_that_fits_without_offload():
    from titan_npu.planner.hardware import hardware
    from titan_npu.planner.search import make_plan

    cfg = load_config(CONFIGS / "qwen3_235b_a22b.toml")
    # The same 1024-sequence global batch on 8 nodes: only layouts keeping the state in host memory fit.
    smaller = make_plan(cfg, 8, 8, hardware("910B2"))
    assert smaller.ranked and all(c.layout.cpu_offload for c in smaller.ranked)


def test_the_128k_config_is_llama_3_1_with_its_rope_scaling_on_the_planners_context_parallel_layout():
    from titan_npu.models.registry import build_model_args
    from titan_npu.planner.dry_run import dry_run
    from titan_npu.planner.hardware import hardware
    from titan_npu.planner.search import make_plan
    from titan_npu.planner.verify import compare_with_plan

    cfg = load_config(CONFIGS / "llama3_8b_128k.toml")
    args = build_model_args(cfg.model)
    assert (args.rope_scaling_factor, args.rope_theta, args.max_seq_len) == (8.0, 500000.0, 131072)
    assert cfg.training.seq_len == 131072
    plan = make_plan(cfg, 1, 8, hardware("910B2"))
    assert plan.config_candidate is not None and plan.config_candidate.fits, plan.config_error
    assert plan.ranked[0].layout == plan.config_candidate.layout
    assert (plan.ranked[0].layout.cp, plan.ranked[0].layout.cp_mode) == (2, "ring")
    comparison = compare_with_plan(dry_run(cfg, 8, 5, forward=False), cfg)
    assert comparison["match"], comparison["problems"]


def test_the_1b_benchmark_config_has_llama_3_2_1b_shapes_compiled_in_bf16():
    from titan_npu.models.registry import build_model_args

    cfg = load_config(CONFIGS / "llama3_1b.toml")
    a = build_model_args(cfg.model)
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_dim, a.vocab_size) == (2048, 16, 32, 8, 8192, 128256)
    assert (a.rope_theta, a.rope_scaling_factor) == (500000.0, 32.0)
    assert (cfg.training.dtype, cfg.training.seq_len, cfg.compile.enable) == ("bf16", 2048, True)


def test_debug_config_is_the_tiny_cpu_run():
    cfg = load_config(CONFIGS / "debug.toml")
    m, t = cfg.model, cfg.training
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.vocab_size) == (256, 4, 8, 4, 512)
    assert (t.seq_len, t.batch_size, t.max_steps, t.dtype) == (256, 8, 200, "fp32")
    assert cfg.optimizer.lr == 3e-3
    s = cfg.lr_scheduler
    assert (s.warmup_steps, s.decay_type, s.min_lr_ratio) == (20, "cosine", 0.1)
    assert (cfg.data.path, cfg.data.tokenizer, cfg.data.num_workers) == ("", "byte", 0)
    c = cfg.checkpoint
    assert (c.save_interval, c.keep_last_n, c.async_save) == (100, 2, False)
    assert (cfg.metrics.log_interval, cfg.metrics.tensorboard) == (10, False)


@pytest.mark.parametrize(
    ("guide", "canonical"),
    [("llama_7b.toml", "llama2_7b.toml"), ("llama_13b.toml", "llama2_13b.toml"), ("llama_70b.toml", "llama2_70b.toml")],
)
def test_guide_named_files_describe_the_same_run_as_the_canonical_ones(guide, canonical):
    a, b = load_config(CONFIGS / guide), load_config(CONFIGS / canonical)
    for section, keys in {
        "model": ("name", "flavor", "dim", "n_layers", "n_heads", "vocab_size", "max_seq_len"),
        "training": ("batch_size", "seq_len", "gradient_accumulation_steps", "max_steps", "dtype"),
        "optimizer": ("lr", "betas", "eps", "weight_decay"),
        "lr_scheduler": ("warmup_steps", "decay_type", "min_lr_ratio"),
        "parallel": ("tp_degree", "pp_degree", "dp_shard", "fsdp"),
        "activation_checkpoint": ("mode",),
    }.items():
        for key in keys:
            assert getattr(getattr(a, section), key) == getattr(getattr(b, section), key), f"{section}.{key}"


def test_the_yaml_qwen3_32b_is_the_toml_one_in_the_guide_spelling():
    from titan_npu.config.loader import config_to_dict

    assert config_to_dict(load_config(CONFIGS / "qwen3_32b.yaml")) == config_to_dict(
        load_config(CONFIGS / "qwen3_32b.toml"))
    yaml = (CONFIGS / "qwen3_32b.yaml").read_text()
    for spelling in ("learning_rate:", "  checkpoint:", "max_keep:", "dp_degree:", "tp_size:", "\ndtype: bf16"):
        assert spelling in yaml


def test_guide_named_files_use_the_guide_spellings():
    toml = (CONFIGS / "llama_7b.toml").read_text()
    for spelling in ("[distributed]", "d_model =", "tp_size =", "pp_size =", "steps =", "local_batch_size ="):
        assert spelling in toml
    yaml = (CONFIGS / "llama3_7b.yaml").read_text()
    for spelling in ("learning_rate:", "  checkpoint:", "max_keep:", "dp_degree:", "\ndtype: bf16"):
        assert spelling in yaml


def test_large_models_use_tensor_parallel_and_full_checkpointing():
    for name in ("llama2_70b.toml", "llama3_70b.toml", "llama_70b.toml"):
        cfg = load_config(CONFIGS / name)
        assert cfg.parallel.tp_degree == 8, name
        assert cfg.activation_checkpoint.mode == "full", name
        assert cfg.model.n_kv_heads % cfg.parallel.tp_degree == 0, name


def test_docs_describe_every_key_and_alias():
    text = DOCS.read_text()
    missing = [f"{s}.{k}" for s in section_types() for k in field_types(s) if f"`{k}`" not in text]
    missing += [f"[{s}]" for s in section_types() if f"[{s}]" not in text]
    aliases = [*SECTION_ALIASES, *TOP_LEVEL_ALIASES, *(k for _, k in KEY_ALIASES), *(k for _, k in SUBSECTION_ALIASES)]
    missing += [a for a in aliases if a not in text]
    assert not missing, f"docs/config.md does not mention: {missing}"


def test_config_suffixes_are_only_the_loadable_ones():
    assert {Path(p).suffix for p in CONFIGS.iterdir() if not p.name.startswith(".")} <= {".toml", ".yaml", ".yml"}
