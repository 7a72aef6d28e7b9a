"""`titan-npu plan`: per-rank memory of the config's layout, whether it fits, and the fastest layouts that do.

    titan-npu plan --config configs/llama2_70b.toml --nodes 8 --devices-per-node 8 --device 910B2
    titan-npu plan --config configs/llama2_7b.toml --nodes 1 --devices-per-node 4 --json
    titan-npu plan --config configs/llama2_7b.toml --nodes 1 --devices-per-node 4 --verify --rank 3

Exit code 0 when the config's own layout fits (and --verify agrees), 1 otherwise. The plan itself (what every
candidate keeps, how it is ranked and printed) is planner/.
"""

from __future__ import annotations

import json
import sys

from titan_npu.commands.parsing import CommandParser, parse
from titan_npu.errors import LayoutError
from titan_npu.planner.efficiency import error_band
from titan_npu.planner.hardware import DEVICES, hardware
from titan_npu.planner.plan import format_plan
from titan_npu.planner.search import make_plan


def build_parser() -> CommandParser:
    p = CommandParser(
        prog="titan-npu plan",
        description="Per-rank memory of a config's layout, whether it fits, and the fastest layouts that do. "
                    "Config keys can be overridden as --section.key value.",
    )
    p.add_argument("--config", help="TOML or YAML config file")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument("--device", default="910B2", help=f"device kind ({', '.join(s.name for s in DEVICES.values())})")
    p.add_argument("--device-memory", help="memory per device, e.g. 64GB (default: the device's)")
    p.add_argument("--intra-node-bw", type=float, help="effective collective bandwidth inside a node, GB/s")
    p.add_argument("--inter-node-bw", type=float, help="effective collective bandwidth between nodes, GB/s")
    p.add_argument("--efficiency", type=float,
                   help="fraction of peak FLOPs compute reaches (default: the device type's, fitted on published "
                        "runs)")
    p.add_argument("--reproduce", metavar="RUN",
                   help="plan a published run (its file, or its name as docs/planning.md lists them: the files of "
                        "benchmarks/published/) and print estimate / published")
    p.add_argument("--top", type=int, default=10, help="how many ranked layouts to show")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--verify", action="store_true",
                   help="also build the real parallelized model for --rank on the meta device and compare")
    p.add_argument("--rank", type=int, default=0, help="rank the --verify dry run builds (default 0)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def main(argv: list[str]) -> int:
    """Entry of `titan-npu plan`."""
    from titan_npu.config.loader import load_config

    args, overrides = parse("plan", build_parser(), argv, known=True)
    if args.reproduce:
        return print_reproduction(args.reproduce, args.efficiency, args.json)
    cfg = load_config(args.config, overrides)
    hw = hardware(args.device, args.device_memory, args.intra_node_bw, args.inter_node_bw)
    plan = make_plan(cfg, args.nodes, args.devices_per_node, hw, args.efficiency, args.top)
    report = plan.as_dict()
    report["estimate_error_band"] = error_band()
    agree = True
    verify_text = ""
    if args.verify:
        if plan.config_candidate is None:
            raise LayoutError(f"--verify needs a valid config layout: {plan.config_error}")
        from titan_npu.planner.dry_run import dry_run
        from titan_npu.planner.verify import compare_with_plan

        result = dry_run(cfg, args.nodes * args.devices_per_node, args.rank, device_type=hw.device_type)
        comparison = compare_with_plan(result, cfg)
        agree = comparison["match"]
        report["verify"] = {"dry_run": result.as_dict(), "comparison": comparison}
        verify_text = "\n\n" + result.format() + "\n" + comparison["text"]
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(format_plan(plan) + verify_text)
    fits = plan.config_candidate is not None and plan.config_candidate.fits
    return 0 if agree and fits else 1


def print_reproduction(path: str, efficiency: float | None, as_json: bool) -> int:
    """`plan --reproduce RUN`: the published run planned, its estimate beside the published figure."""
    from titan_npu.planner.reproduce import format_reproduction, load_published, published_path, reproduce

    rep = reproduce(load_published(published_path(path)), efficiency)
    if as_json:
        json.dump({**rep.as_dict(), "estimate_error_band": error_band()}, sys.stdout, indent=2)
        print()
    else:
        print(format_reproduction(rep, error_band()))
    return 0
