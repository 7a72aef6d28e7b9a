"""gpt-oss's [model] resolution: the names that mean it, the published flavors' parameter counts (as the model built
on the meta device holds them; active: OpenAI's 3.6B and 5.1B plus the embedding), the layer pattern and the
refusals."""

from __future__ import annotations

import pytest
import torch

from titan_npu.config.schema import ModelConfig
from titan_npu.errors import ConfigError
from titan_npu.models.gpt_oss.args import FULL, SLIDING
from titan_npu.models.registry import build_model, build_model_args, parse_model_name


@pytest.mark.parametrize(("name", "expected"), [("gpt_oss", ("gpt_oss", None)), ("gpt-oss-20b", ("gpt_oss", "20B")),
                                                ("GPT_OSS_120B", ("gpt_oss", "120B")), ("gptoss", ("gpt_oss", None))])
def test_the_names_that_mean_gpt_oss(name, expected):
    assert parse_model_name(name) == expected


@pytest.mark.parametrize(("flavor", "total", "active"), [("20B", 20_914_757_184, 4_187_440_704),
                                                         ("120B", 116_829_156_672, 5_711_982_912)])
def test_the_published_flavors_count_the_parameters_the_model_holds(flavor, total, active):
    args = build_model_args(ModelConfig(name="gpt_oss", flavor=flavor))
    with torch.device("meta"):
        model = build_model(args)
    assert sum(p.numel() for p in model.parameters()) == args.num_params() == total
    assert args.num_active_params() == active
    assert args.layer_types[:3] == [SLIDING, FULL, SLIDING] and args.window(0) == 128 and args.window(1) is None


def test_config_keys_override_the_flavor_and_bad_ones_are_refused():
    args = build_model_args(ModelConfig(name="gpt_oss", sliding_window=32, swiglu_limit=5.0, yarn_factor=0,
                                        layer_types=[FULL, FULL, SLIDING, SLIDING]))
    assert (args.sliding_window, args.swiglu_limit, args.yarn_factor) == (32, 5.0, None)
    assert [args.window(i) for i in range(4)] == [None, None, 32, 32]
    with pytest.raises(ConfigError, match="must give 'sliding_attention' or 'full_attention' for each of the 4"):
        build_model_args(ModelConfig(name="gpt_oss", layer_types=[FULL]))
    with pytest.raises(ConfigError, match="no capacity factor"):
        build_model_args(ModelConfig(name="gpt_oss", capacity_factor=1.25))
