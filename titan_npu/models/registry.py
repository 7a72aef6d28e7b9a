"""The model families this framework trains, by `model.name`: the one place that imports a family.

A new family is a folder under models/ with a spec.py that builds its ModelSpec, and one entry in SPECS below.
Everything else reaches a family through these functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from titan_npu.errors import CheckpointError, ConfigError
from titan_npu.models.deepseek_v3.spec import DEEPSEEK_V3
from titan_npu.models.deepseek_v32.spec import DEEPSEEK_V32
from titan_npu.models.glm4_moe.spec import GLM4_MOE
from titan_npu.models.gpt_oss.spec import GPT_OSS
from titan_npu.models.llama.spec import LLAMA2, LLAMA3
from titan_npu.models.qwen2.spec import QWEN2
from titan_npu.models.qwen3.spec import QWEN3
from titan_npu.models.qwen3_moe.spec import QWEN3_MOE
from titan_npu.models.qwen3_next.spec import QWEN3_NEXT
from titan_npu.models.spec import ModelSpec

if TYPE_CHECKING:
    from titan_npu.config.schema import ModelConfig

SPECS: dict[str, ModelSpec] = {spec.name: spec for spec in (LLAMA2, LLAMA3, QWEN2, QWEN3, QWEN3_MOE, DEEPSEEK_V3,
                                                        GPT_OSS, QWEN3_NEXT, GLM4_MOE, DEEPSEEK_V32)}


def family_names() -> list[str]:
    """The model.name of every family."""
    return list(SPECS)


def get_spec(name: str) -> ModelSpec:
    """The family `name` (a canonical model.name), or a ConfigError listing the known ones."""
    spec = SPECS.get(name)
    if spec is None:
        raise ConfigError(f"model.name='{name}' is not a known model (valid: {', '.join(SPECS)}, optionally with a "
                          f"size such as llama3_8b or qwen3_8b)")
    return spec


def spec_of(args: Any) -> ModelSpec:
    """The family of a model's args (their `family` field)."""
    return get_spec(args.family)


def parse_model_name(name: str) -> tuple[str | None, str | None]:
    """'llama3_8b' -> ('llama3', '8B'), 'qwen3-0.6b' -> ('qwen3', '0.6B'), 'qwen2.5' -> ('qwen2', None);
    (None, None) for a name no family claims."""
    for spec in SPECS.values():
        match = spec.name_pattern.fullmatch(name.strip())
        if match is None:
            continue
        groups = match.groupdict()
        size = f"{groups['size']}B" if groups.get("size") else None
        return spec.name, spec.versioned_flavor(groups.get("version"), size)
    return None, None


def published_flavor(family: str, dim: int, n_layers: int) -> str | None:
    """The flavor of `family` that a bare family name with these dims means (the TOML guide's name = "llama",
    d_model = 4096, n_layers = 32 is Llama 2 7B), or None."""
    return get_spec(family).published_sizes.get((dim, n_layers))


def build_model_args(model_cfg: ModelConfig) -> Any:
    """Resolve [model] into its family's args: the flavor's preset, then every explicit (non-None) field on top."""
    family, size = parse_model_name(model_cfg.name)
    if family is None:
        raise ConfigError(f"model.name='{model_cfg.name}' is not a known model (valid: {', '.join(SPECS)}, "
                          f"optionally with a size like llama3_8b or qwen3_8b)")
    spec = SPECS[family]
    size_in_name = None if size is None else spec.canonical_flavor(size)
    flavor = spec.canonical_flavor(model_cfg.flavor or "debug")
    if size_in_name is not None:
        # A size in the name (llama2_13b) selects the flavor; only a different explicit size conflicts with it.
        if flavor not in ("debug", size_in_name):
            raise ConfigError(
                f"model.name='{model_cfg.name}' says {size_in_name} but model.flavor='{model_cfg.flavor}'; "
                f"drop the size from the name or set flavor = \"{size_in_name}\""
            )
        flavor = size_in_name
    return spec.build_args(model_cfg, flavor)


def build_model(args: Any) -> nn.Module:
    """The whole model of `args` (call under `torch.device("meta")` to allocate nothing)."""
    return spec_of(args).build_model(args)


def spec_for_hf_config(config: dict[str, Any]) -> ModelSpec:
    """The family that reads a Hugging Face config.json, by its model_type; a CheckpointError naming the ones known."""
    model_type = config.get("model_type", "llama")
    for spec in SPECS.values():
        if spec.hf is not None and model_type in spec.hf.model_types:
            return spec
    known = sorted({t for spec in SPECS.values() if spec.hf is not None for t in spec.hf.model_types})
    raise CheckpointError(f"config.json model_type='{model_type}' is not a model this framework trains "
                          f"(known: {', '.join(known)})")


def args_from_dict(fields: dict[str, Any]) -> Any:
    """A model's args from the fields a checkpoint stores (their `family` names the family; Llama 2 if absent)."""
    return get_spec(fields.get("family", "llama2")).args_from_dict(fields)


def read_meta_checkpoint(params: dict[str, Any], shards: list[dict[str, Any]]) -> tuple[dict[str, Any], Any]:
    """(our state dict, args) of a Meta consolidated checkpoint: params.json and its shards in order."""
    readers = [spec.read_meta for spec in SPECS.values() if spec.read_meta is not None]
    return readers[0](params, shards)


def args_from_hf_config(config: dict[str, Any]) -> Any:
    """A model's args from a Hugging Face config.json of any known model_type."""
    return spec_for_hf_config(config).hf.args_from_config(config)
