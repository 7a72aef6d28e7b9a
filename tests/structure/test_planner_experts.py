"""The planner reads a MoE model's routing only through its spec's expert terms: no module of titan_npu/planner/
names the shared MoE block's arguments (models/moe/args.py's MOE_KEYS, and the args' is_moe_layer, n_moe_layers and
moe_args()); ModelSpec.experts (models/moe/cost.py's MOE_EXPERTS) gives what it needs, None for a dense family."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from titan_npu.models.moe.args import MOE_KEYS
from titan_npu.models.registry import SPECS

PLANNER = Path(__file__).resolve().parents[2] / "titan_npu" / "planner"
# The shared MoE block's interface on a family's args (models/spec.py's docstring), beside its [model] keys.
MOE_INTERFACE = ("is_moe_layer", "n_moe_layers", "moe_args")


def moe_argument_names() -> set[str]:
    """Every name of the shared MoE block's arguments the planner must not read directly."""
    return set(MOE_KEYS) | set(MOE_INTERFACE)


def moe_argument_uses(paths: Iterable[Path], root: Path) -> list[str]:
    """'file:line: name' for each MoE argument that `paths` name as a whole word (code, comment or string)."""
    names = sorted(moe_argument_names(), key=len, reverse=True)
    pattern = re.compile(rf"(?<![A-Za-z0-9_])(?:{'|'.join(map(re.escape, names))})(?![A-Za-z0-9_])")
    return [f"{path.relative_to(root)}:{number}: {m.group(0)}"
            for path in paths for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            for m in pattern.finditer(line)]


def _args(name: str):
    spec = SPECS[name]
    flavor = next(iter(spec.flavors))
    return spec.args_from_dict({**spec.flavors[flavor], "family": name})


def test_no_planner_module_names_a_moe_argument():
    found = moe_argument_uses(sorted(PLANNER.rglob("*.py")), PLANNER.parent)
    assert not found, ("planner/ reads the shared MoE block's arguments directly; use the family's "
                       "ModelSpec.experts (models/spec.py's ExpertTerms, models/moe/cost.py) instead:\n"
                       + "\n".join(found))


def test_the_check_catches_a_planted_use(tmp_path):
    assert {"n_experts", "top_k", "moe_ffn_dim", "is_moe_layer", "n_moe_layers", "moe_args"} <= moe_argument_names()
    planted = tmp_path / "planted.py"
    planted.write_text("x = a.top_k * a.dim\n# the experts' copies\nm = args.moe_args()\ny = a.top_k_share\n")
    assert moe_argument_uses([planted], tmp_path) == ["planted.py:1: top_k", "planted.py:3: moe_args"]


def test_a_family_with_moe_layers_gives_expert_terms_that_match_its_args():
    moe_families = []
    for name, spec in SPECS.items():
        args = _args(name)
        assert (spec.experts is None) == (not hasattr(args, "is_moe_layer")), name
        if spec.experts is None or not spec.experts.n_moe_blocks(args):
            continue
        moe_families.append(name)
        e, m = spec.experts, args.moe_args()
        layers = [i for i in range(args.n_layers) if e.moe_block(args, i)]
        assert layers == [i for i in range(args.n_layers) if args.is_moe_layer(i)]
        assert e.n_moe_blocks(args) == len(layers) == args.n_moe_layers
        assert (e.n_routed(args), e.routed_copies(args), e.all_to_all_width(args)) == (m.n_experts, m.top_k, args.dim)
        assert e.routed_active_params(args) == len(layers) * m.top_k * 3 * args.dim * m.ffn_dim
        assert e.describe(args) == (f"{len(layers)} MoE layers of {m.n_experts} experts (top {m.top_k}, "
                                    f"ffn {m.ffn_dim})")
    assert len(moe_families) >= 3, moe_families
