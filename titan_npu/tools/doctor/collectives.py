"""The collective check under torchrun: all_reduce / all_gather / broadcast timed per rank, and the bus bandwidth."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

from titan_npu.tools.doctor.report import Report
from titan_npu.tools.doctor.side_channel import RanksMissing, check_in, leave, open_side_channel, wait_for_keys


@dataclass
class CollectiveResult:
    """One collective at one size: each rank's mean time and the bandwidth it implies."""

    op: str
    size_bytes: int
    times_s: dict[int, float]

    @property
    def slowest_rank(self) -> int:
        return max(self.times_s, key=self.times_s.get)

    @property
    def time_s(self) -> float:
        return max(self.times_s.values())

    def algbw(self) -> float:
        return self.size_bytes / self.time_s

    def busbw(self) -> float:
        """Bus bandwidth (nccl-tests' convention): what each link carried, comparable across collectives."""
        n = len(self.times_s)
        factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "broadcast": 1.0}[self.op]
        return self.algbw() * factor

    def as_dict(self) -> dict:
        return {"op": self.op, "size_bytes": self.size_bytes, "times_s": self.times_s,
                "slowest_rank": self.slowest_rank, "algbw_gbs": self.algbw() / 1e9, "busbw_gbs": self.busbw() / 1e9}


COLLECTIVES = ("all_reduce", "all_gather", "broadcast")


def _launch(op: str, tensor, out):
    import torch.distributed as dist

    if op == "all_reduce":
        return dist.all_reduce(tensor, async_op=True)
    if op == "all_gather":
        # all_gather_single is the newer name (torch >= 2.12) of all_gather_into_tensor.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(out, tensor, async_op=True)
    return dist.broadcast(tensor, src=0, async_op=True)


def run_collectives(store, rank: int, world_size: int, device, sizes: list[int], timeout_s: float,
                    iters: int = 3, ops: tuple[str, ...] = COLLECTIVES) -> list[tuple[str, int, float]]:
    """Time each op at each size on the joined process group; a rank that never arrives is named, not waited on.

    Before each (op, size) a rank sets an arrival key; when the first call does not complete within timeout_s,
    the ranks without an arrival key are the ones that did not answer.
    """
    import torch

    from titan_npu.device import synchronize

    done = []
    for i, (op, size) in enumerate((op, size) for op in ops for size in sizes):
        numel = max(world_size, size // 4 // world_size * world_size)
        tensor = torch.ones(numel if op != "all_gather" else numel // world_size, device=device.torch_device)
        out = torch.empty(numel, device=device.torch_device) if op == "all_gather" else None
        store.set(f"arrive/{i}/{rank}", "1")
        where = f"{op} of {_human(numel * 4)}"
        elapsed = []
        for it in range(iters + 1):  # the first call is a warm-up (connection set-up, buffers)
            synchronize(device)
            t0 = time.perf_counter()
            work = _launch(op, tensor, out)
            try:
                work.wait(timeout=timedelta(seconds=timeout_s))
            except RuntimeError as e:
                missing = wait_for_keys(store, {r: f"arrive/{i}/{r}" for r in range(world_size)}, time.monotonic())
                raise RanksMissing(f"{where} within {timeout_s:.0f}s", missing, arrived_all=not missing) from e
            synchronize(device)
            if it:
                elapsed.append(time.perf_counter() - t0)
        done.append((op, numel * 4, sum(elapsed) / len(elapsed)))
    return done


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def collect_results(store, rank: int, world_size: int, mine: list[tuple[str, int, float]], reporter: bool,
                    timeout_s: float) -> list[CollectiveResult]:
    """Share every rank's times through the store; the reporter assembles them."""
    store.set(f"times/{rank}", json.dumps(mine))
    if not reporter:
        return []
    missing = wait_for_keys(store, {r: f"times/{r}" for r in range(world_size)}, time.monotonic() + timeout_s)
    if missing:
        raise RanksMissing(f"reporting times within {timeout_s:.0f}s", missing)
    per_rank = {r: json.loads(store.get(f"times/{r}")) for r in range(world_size)}
    results = []
    for j, (op, size, _) in enumerate(mine):
        results.append(CollectiveResult(op, size, {r: per_rank[r][j][2] for r in range(world_size)}))
    return results


def format_collectives(results: list[CollectiveResult], backend: str, world_size: int, hosts: int) -> list[str]:
    """The collective table: per op and size, the ranks' time range, slowest rank, algorithm and bus bandwidth."""
    lines = [f"{'op':<11} {'size':>10}  {'time min..max (ms)':>20}  {'slowest':>7}  {'algbw GB/s':>10}  "
             f"{'busbw GB/s':>10}"]
    for r in results:
        times = r.times_s.values()
        lines.append(f"{r.op:<11} {_human(r.size_bytes):>10}  {1e3 * min(times):>9.2f}..{1e3 * max(times):<9.2f}  "
                     f"{'rank ' + str(r.slowest_rank):>7}  {r.algbw() / 1e9:>10.2f}  {r.busbw() / 1e9:>10.2f}")
    lines.insert(0, f"{backend}, {world_size} ranks on {hosts} host(s); per-rank times in --json")
    return lines


def compare_ranks(report: Report, payloads: dict[int, dict]) -> None:
    """Every rank should run the same stack: name the ranks whose versions differ from rank 0's."""
    s = "collectives"
    base = payloads[min(payloads)]["versions"]
    for key in ("torch", "torch_npu", "cann", "npu_driver", "nvidia_driver"):
        groups: dict[str, list[int]] = {}
        for r, p in payloads.items():
            groups.setdefault(str(p["versions"].get(key)), []).append(r)
        if len(groups) > 1:
            detail = "; ".join(f"{v} on ranks {_ranks(rs)}" for v, rs in groups.items())
            report.add("fail", s, f"{key} differs between ranks: {detail} (base {base.get(key)}); mismatched "
                                  "drivers or CANN across nodes are a common cause of HCCL init errors")


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"


def collective_check(report: Report, versions: dict, timeout_s: float, sizes: list[int], iters: int,
                     backend: str | None = None) -> int:
    """Check-in, then collectives on the job's backend; rank 0 reports the table. Returns 0 or 1."""
    import torch.distributed as dist

    from titan_npu.device import setup_device

    s = "collectives"
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device = setup_device(backend or "auto")
    payload = {"host": socket.gethostname(), "pid": os.getpid(), "local_rank": os.environ.get("LOCAL_RANK", "0"),
               "device": device.type, "versions": versions}
    store = None
    try:
        store = open_side_channel(rank, world_size, timeout_s)
        payloads = check_in(store, rank, world_size, payload, timeout_s)
        hosts = len({p["host"] for p in payloads.values()})
        compare_ranks(report, payloads)
        dist.init_process_group(device.backend, store=dist.PrefixStore("pg/", store), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        mine = run_collectives(store, rank, world_size, device, sizes, timeout_s, iters)
        results = collect_results(store, rank, world_size, mine, reporter=rank == 0, timeout_s=timeout_s)
        dist.destroy_process_group()
        report.facts["collectives"] = [r.as_dict() for r in results]
        if results:
            header, *table = format_collectives(results, device.backend, world_size, hosts)
            report.add("ok", s, header)
            for line in table:
                report.add("table", s, line)
        leave(store, rank, world_size, timeout_s)
        return 0
    except RanksMissing as e:
        hint = "" if e.arrived_all else "; their hosts/logs show why (crashed, not launched, unreachable network)"
        report.add("fail", s, f"{e}{hint}")
        report.facts["missing_ranks"] = e.missing
        # A collective that timed out leaves the backend's threads waiting: leave without tearing the group down.
        report.facts["hung"] = dist.is_initialized()
        if store is not None and not report.facts["hung"]:
            leave(store, rank, world_size, 1.0)
        return 1
    except Exception as e:  # the backend's own errors (HCCL/NCCL init, transport): one line, then leave
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        report.add("fail", s, f"rank {rank}: {device.backend} failed: {type(e).__name__}: {first}; check the "
                              "versions and variables above, and that every node reaches the others")
        report.facts["hung"] = dist.is_initialized()
        return 1
