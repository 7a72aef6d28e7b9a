"""`titan-npu doctor`'s command line: run every check family, print the report, exit 0 (no failures) or 1."""

from __future__ import annotations

import json
import os
import socket
import sys

from titan_npu.commands.launch import check_launch_env
from titan_npu.commands.parsing import CommandParser, parse
from titan_npu.tools.doctor.collectives import collective_check
from titan_npu.tools.doctor.devices import check_devices
from titan_npu.tools.doctor.disk import check_disk
from titan_npu.tools.doctor.environment import check_environment
from titan_npu.tools.doctor.report import Report
from titan_npu.tools.doctor.versions import check_versions

MAX_SIZE_MIB = 16384  # the largest collective message --sizes may ask for: 16 GiB on every device


def build_parser() -> CommandParser:
    p = CommandParser(prog="titan-npu doctor",
                                description="Check versions, devices, environment, disk and (under torchrun) "
                                            "collectives. Config keys can be overridden as --section.key value.")
    p.add_argument("--config", help="config file: adds the disk check and the variables the run will set")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds to wait for every rank at check-in and at each collective (default 60)")
    p.add_argument("--sizes", default="1,16,64", help="collective message sizes in MiB, comma separated")
    p.add_argument("--iters", type=int, default=3, help="timed repetitions of each collective (after a warm-up)")
    p.add_argument("--backend", help="process-group backend for the collective check (default: the device's)")
    p.add_argument("--no-collectives", action="store_true", help="skip the collective check under torchrun")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def _parse_sizes(text: str) -> list[int]:
    from titan_npu.errors import ConfigError

    try:
        sizes = [int(float(x) * 1024**2) for x in text.split(",") if x.strip()]
    except (ValueError, OverflowError):  # not a number, nan, inf
        sizes = []
    if not sizes or min(sizes) <= 0 or max(sizes) > MAX_SIZE_MIB * 1024**2:
        raise ConfigError(f"--sizes {text!r} must be positive MiB values up to {MAX_SIZE_MIB} (each is a buffer on "
                          f"every device) separated by commas, e.g. 1,16,64")
    return sizes


def main(argv: list[str]) -> int:
    """Entry of `titan-npu doctor`."""
    args, overrides = parse("doctor", build_parser(), argv, known=True)
    sizes = _parse_sizes(args.sizes)
    check_launch_env()  # it reads RANK, LOCAL_RANK and WORLD_SIZE below
    cfg = None
    if args.config or overrides:
        from titan_npu.config.loader import load_config

        cfg = load_config(args.config, overrides)
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    report = Report()
    versions = check_versions(report)
    devices = check_devices(report)
    env = check_environment(report, devices.get("type"), cfg)
    if cfg is not None:
        check_disk(report, cfg)
    report.facts.update(versions=versions, devices=devices, environment=env, host=socket.gethostname(), rank=rank,
                        world_size=world_size)
    code = 0
    if world_size > 1 and not args.no_collectives:
        code = collective_check(report, versions, args.timeout, sizes, args.iters, args.backend)
    elif world_size == 1:
        report.add("info", "collectives", "single process: run under torchrun to check collectives and bandwidth")
    failures = report.count("fail")
    report.add("fail" if failures else "ok", "summary",
               f"{failures} failure(s), {report.count('warn')} warning(s) on {socket.gethostname()} (rank {rank})")
    _print(report, args.json, rank, local_rank)
    code = 1 if failures or code else 0
    if report.facts.get("hung"):
        sys.stdout.flush()
        sys.stderr.flush()
        # A hung collective's backend threads would block a normal interpreter exit until the group's timeout.
        os._exit(code)
    return code


def _print(report: Report, as_json: bool, rank: int, local_rank: int) -> None:
    """Local rank 0 prints its node's checks; rank 0 the collectives; other ranks only their warnings/failures."""
    if as_json:
        if rank == 0 or local_rank == 0:
            print(json.dumps({"findings": [f.__dict__ for f in report.findings], "facts": report.facts},
                             indent=2, default=str))
        return
    if local_rank == 0 or rank == 0:
        header = f"titan-npu doctor on {socket.gethostname()}"
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            header += f" (rank {rank} of {os.environ['WORLD_SIZE']})"
        print(header)
        print(report.format())
    else:
        text = report.format(levels=("warn", "fail"))
        if text:
            print("\n".join(f"[rank {rank}] {line}" for line in text.splitlines()))
    sys.stdout.flush()
