"""The configuration's half of "a family owns its configuration": config/schema.py's ModelConfig holds only the
[model] keys every family shares, and no key that only some families have is named in the config's schema, options
table or aliases (a family declares its keys in its own folder: ModelSpec.model_keys)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from titan_npu.config.schema import ModelConfig
from titan_npu.models.registry import SPECS

CONFIG = Path(__file__).resolve().parents[2] / "titan_npu" / "config"
# What every family shares and the framework itself reads: the family, its preset, the attention kernel and RoPE's
# precision switches. A new shared key is a decision: add it here and say so in docs/models.md.
SHARED = ["name", "flavor", "use_flash_attention", "attention_backend", "rope_fp32"]


def test_model_config_has_only_the_shared_fields():
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    extra = sorted(set(fields) - set(SHARED))
    assert fields == SHARED, ("config/schema.py ModelConfig gained a field that not every family shares: declare it "
                              f"in the family's folder (ModelSpec.model_keys) instead: {extra}")


def _family_only_keys() -> set[str]:
    every = [set(spec.model_keys) for spec in SPECS.values()]
    return set.union(*every) - set.intersection(*every)


def test_no_family_only_key_is_named_in_the_configs_schema_options_or_aliases():
    family_only = _family_only_keys()
    assert "q_lora_rank" in family_only and "dim" not in family_only
    found = {}
    for name in ("schema.py", "options.py", "aliases.py"):
        text = (CONFIG / name).read_text(encoding="utf-8")
        named = sorted(key for key in family_only if re.search(rf"\b{re.escape(key)}\b", text))
        if named:
            found[name] = named
    assert found == {}, f"family-only [model] keys named in config/: {found} (they belong in the family's folder)"


def test_every_family_declares_its_keys_and_none_shadows_a_shared_one():
    for name, spec in SPECS.items():
        assert spec.model_keys, f"{name} declares no [model] keys"
        assert not set(spec.model_keys) & set(SHARED), f"{name} redeclares a shared key"
