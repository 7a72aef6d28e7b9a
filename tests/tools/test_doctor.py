"""`titan-npu doctor`: version pairing, CANN/driver discovery, environment checks, disk, and the collective check
under torchrun, including the rank that never answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan_npu.commands import doctor as doctor_command
from titan_npu.config.loader import load_config
from titan_npu.parallel.process_group import free_port
from titan_npu.tools import doctor
from titan_npu.tools.doctor.environment import _interface_matches

ROOT = Path(__file__).resolve().parents[2]


def _levels(report: doctor.Report, section: str) -> list[tuple[str, str]]:
    return [(f.level, f.message) for f in report.findings if f.section == section]


# --- versions -----------------------------------------------------------------------------------------------------


def test_release_versions_order_candidates_before_the_release():
    order = ["7.0.0", "8.0.RC1", "8.0.RC2", "8.0.RC3", "8.0.0", "8.1.RC1"]
    assert sorted(order, key=doctor.parse_release) == order
    assert doctor.parse_release("24.1.rc2") < doctor.parse_release("24.1.0") < doctor.parse_release("25.0.RC1")


@pytest.mark.parametrize("torch_version,torch_npu_version", [
    ("2.1.0", "2.1.0.post3"), ("2.13.0+cpu", "2.13.0"), ("2.10.0", "2.10.0rc2"), ("2.1.0a0+git", "2.1.0.post17"),
    ("2.4.0", "2.1.0.post10"), ("2.6.0+cpu", "2.5.1.post1"), ("2.1", "2.1.0.post1"), ("2.5.1", "unknown"),
])
def test_torch_npu_pairing_is_the_device_layers_rule(torch_version, torch_npu_version):
    # One rule for both: what the doctor reports is what device setup would refuse, with the same message.
    from titan_npu.device.npu import check_torch_npu_version
    from titan_npu.errors import DeviceError

    try:
        check_torch_npu_version(torch_version, torch_npu_version)
        refusal = None
    except DeviceError as e:
        refusal = str(e)
    findings = doctor.stack_findings({"torch": torch_version, "torch_npu": torch_npu_version}, None)
    pairing = [(level, m) for level, m in findings if m.startswith(f"torch_npu {torch_npu_version} ")]
    assert len(pairing) == 1, findings
    if refusal is None:
        assert pairing[0][0] in ("ok", "info"), pairing
    else:
        assert pairing == [("fail", refusal)]


def test_matching_stack_is_ok():
    findings = doctor.stack_findings({"torch": "2.10.0", "torch_npu": "2.10.0", "cann": "9.0.0",
                                      "npu_driver": "25.5.0"}, "/usr/local/Ascend/ascend-toolkit/latest")
    assert [level for level, _ in findings] == ["ok"] * len(findings)


def test_a_torch_older_than_the_floor_fails():
    findings = doctor.stack_findings({"torch": "2.9.1"}, None)
    assert ("fail", "torch 2.9.1 is older than 2.10, the oldest titan-npu runs on; install torch >= 2.10 (with "
                    "the torch_npu of the same version on Ascend)") in findings


def test_torch_npu_built_for_another_torch_fails_with_the_fix():
    findings = doctor.stack_findings({"torch": "2.4.0", "torch_npu": "2.1.0.post10"}, None)
    fails = [m for level, m in findings if level == "fail"]
    assert any("install torch==2.1.0" in m for m in fails)
    assert any("CANN toolkit not found" in m and "set_env.sh" in m for m in fails)


def test_torch_npu_and_cann_from_different_releases_warn():
    findings = doctor.stack_findings({"torch": "2.1.0", "torch_npu": "2.1.0.post10", "cann": "8.0.RC2"}, "/x")
    assert any(level == "warn" and "released for CANN 8.0.0, installed is CANN 8.0.RC2" in m
               for level, m in findings)


def test_driver_older_than_the_cann_release_needs_fails():
    findings = doctor.stack_findings({"torch": "2.1.0", "torch_npu": "2.1.0.post10", "cann": "8.0.0",
                                      "npu_driver": "23.0.3"}, "/x")
    assert any(level == "fail" and "older than 24.1.0" in m for level, m in findings)


def test_cuda_newer_than_the_driver_supports_fails():
    findings = doctor.stack_findings({"torch": "2.5.0", "torch_cuda": "12.4", "nvidia_driver": "525.60",
                                      "nvidia_cuda": "12.0"})
    assert any(level == "fail" and "CUDA up to 12.0" in m for level, m in findings)


@pytest.mark.parametrize("relative,text,version", [
    ("version.cfg", "# version: 1.0\nruntime_running_version=[7.0.0.5.242:8.0.RC2]\n", "8.0.RC2"),
    ("aarch64-linux/ascend_toolkit_install.info", "package_name=Ascend-cann-toolkit\nversion=8.0.0\n", "8.0.0"),
    ("compiler/version.info", "Version=8.1.RC1\n", "8.1.RC1"),
])
def test_cann_version_is_read_from_the_toolkit_files(tmp_path, monkeypatch, relative, text, version):
    path = tmp_path / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    home = doctor.ascend_toolkit_home()
    assert home == tmp_path
    assert doctor.read_cann_version(home) == version


def test_npu_driver_version_is_read_from_version_info(tmp_path):
    (tmp_path / "version.info").write_text("Version=24.1.rc2\nascendhal_version=7.35.23\n")
    assert doctor.read_npu_driver_version(tmp_path) == "24.1.rc2"


# --- environment and disk -----------------------------------------------------------------------------------------


def test_interface_specs_follow_nccl_syntax():
    names = ["lo", "eth0", "eth1", "docker0", "ib0"]
    assert _interface_matches("eth", names) == ["eth0", "eth1"]
    assert _interface_matches("=eth0", names) == ["eth0"]
    assert _interface_matches("^docker,lo", names) == ["eth0", "eth1", "ib0"]
    assert _interface_matches("bond", names) == []


def test_an_hccl_exec_timeout_not_below_the_collective_timeout_and_the_inference_task_queue_are_named(monkeypatch):
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "1800")
    monkeypatch.setenv("TASK_QUEUE_ENABLE", "2")
    report = doctor.Report()
    doctor.check_environment(report, "npu")
    warned = [m for lvl, m in _levels(report, "communication environment") if lvl == "warn"]
    assert any(m.startswith("HCCL_EXEC_TIMEOUT=1800 is 1800 s, not below comm.timeout_s=1800") and "plog" in m
               for m in warned)
    assert any(m.startswith("TASK_QUEUE_ENABLE=2 is torch_npu's pure-inference level") for m in warned)


def test_environment_settings_that_bite_are_named(monkeypatch):
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "60")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nosuchif")
    monkeypatch.setenv("HCCL_IF_IP", "203.0.113.7")  # TEST-NET-3: never an address of this host
    monkeypatch.setenv("HCCL_BUFFSIZE", "400")
    report = doctor.Report()
    env = doctor.check_environment(report, "npu")
    found = _levels(report, "communication environment")
    assert env["HCCL_BUFFSIZE"] == "400"
    assert any(lvl == "info" and m.startswith("HCCL_BUFFSIZE=400  -- MB of device memory") for lvl, m in found)
    assert any(lvl == "warn" and "HCCL_EXEC_TIMEOUT=60s" in m for lvl, m in found)
    assert any(lvl == "fail" and "NCCL_SOCKET_IFNAME=nosuchif matches no network interface" in m for lvl, m in found)
    assert any(lvl == "fail" and "HCCL_IF_IP=203.0.113.7 is not an address of this host" in m for lvl, m in found)


def test_config_adds_the_variables_the_run_will_set(monkeypatch):
    monkeypatch.delenv("HCCL_CONNECT_TIMEOUT", raising=False)
    cfg = load_config(ROOT / "configs" / "llama_70b.toml", [])
    report = doctor.Report()
    doctor.check_environment(report, "npu", cfg)
    assert any("the run will set HCCL_CONNECT_TIMEOUT=3600" in m for _, m in _levels(report, "communication "
                                                                                          "environment"))


def test_disk_check_compares_free_space_with_the_checkpoints_the_config_keeps(tmp_path):
    small = load_config(ROOT / "configs" / "debug.toml", ["--checkpoint.dir", str(tmp_path / "ck"),
                                                           "--checkpoint.async_save", "false"])
    report = doctor.Report()
    facts = doctor.check_disk(report, small)
    assert facts["checkpoint_bytes"] == 12 * small_params(small)  # fp32 weights + AdamW's two moments
    assert _levels(report, "disk")[0][0] == "ok"
    # Keeping a million checkpoints needs more disk than any machine has.
    huge = load_config(ROOT / "configs" / "debug.toml", ["--checkpoint.dir", str(tmp_path / "ck"),
                                                          "--checkpoint.keep_last_n", "1000000"])
    report = doctor.Report()
    doctor.check_disk(report, huge)
    level, message = _levels(report, "disk")[0]
    assert level == "fail" and "lower checkpoint.keep_last_n" in message


def small_params(cfg) -> int:
    from titan_npu.models.registry import build_model_args

    return build_model_args(cfg.model).num_params()


def test_bus_bandwidth_follows_the_nccl_tests_convention():
    r = doctor.CollectiveResult("all_reduce", 10**9, {0: 0.5, 1: 1.0, 2: 0.8, 3: 0.9})
    assert r.slowest_rank == 1 and r.algbw() == pytest.approx(1e9)
    assert r.busbw() == pytest.approx(1e9 * 2 * 3 / 4)
    assert doctor.CollectiveResult("all_gather", 10**9, {0: 1.0, 1: 1.0}).busbw() == pytest.approx(0.5e9)
    assert doctor.CollectiveResult("broadcast", 10**9, {0: 2.0, 1: 2.0}).busbw() == pytest.approx(0.5e9)


def test_single_process_run_reports_every_section(capsys, monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    code = doctor_command.main([])
    out = capsys.readouterr().out
    for section in ("versions", "devices", "communication environment", "collectives", "summary"):
        assert f"\n{section}\n" in out
    assert "run under torchrun to check collectives" in out
    assert code == (1 if "[fail]" in out else 0)


# --- collectives under torchrun -----------------------------------------------------------------------------------


def _torchrun(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "titan_npu.cli", "doctor", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False)


@pytest.mark.distributed
def test_collective_check_under_torchrun_reports_times_and_bandwidth():
    proc = _torchrun(["--sizes", "0.25,1", "--iters", "2", "--timeout", "60", "--json"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    results = report["facts"]["collectives"]
    assert {(r["op"], r["size_bytes"]) for r in results} == {
        (op, size) for op in ("all_reduce", "all_gather", "broadcast") for size in (2**18, 2**20)}
    for r in results:
        assert set(r["times_s"]) == {"0", "1"} and all(t > 0 for t in r["times_s"].values())
        assert r["busbw_gbs"] > 0 and r["algbw_gbs"] > 0


@pytest.mark.distributed
def test_a_rank_that_never_joins_is_named_within_the_timeout():
    # Rank 0 of a 2-rank job starts alone: rank 1 never comes (not launched, crashed, wrong node).
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "PYTHONWARNINGS": "ignore"}
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "titan_npu.cli", "doctor", "--timeout", "5"], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT, check=False)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1
    assert "check-in within 5s: rank(s) 1 did not answer" in proc.stdout
    assert elapsed < 5 + 60  # the timeout plus start-up, never a hang


STALL_SCRIPT = """
import os, sys, json
from titan_npu.device import setup_device
from titan_npu.parallel.process_group import free_port
from titan_npu.tools import doctor
import torch.distributed as dist
rank, world = int(os.environ["RANK"]), 2
store = doctor.open_side_channel(rank, world, 20)
doctor.check_in(store, rank, world, {"host": "h"}, 20)
dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank, world_size=world)
# Rank 1 answers the all_reduce, then stops before the all_gather (a hang in the data loader, say).
ops = ("all_reduce", "all_gather") if rank == 0 else ("all_reduce",)
try:
    doctor.run_collectives(store, rank, world, setup_device("gloo"), [4096], timeout_s=3, iters=1, ops=ops)
    print(json.dumps({"rank": rank, "ok": True}), flush=True)
except doctor.RanksMissing as e:
    print(json.dumps({"rank": rank, "missing": e.missing, "message": str(e)}), flush=True)
if rank == 1:
    import time; time.sleep(6)  # stay alive (and silent) while rank 0 waits
os._exit(0)
"""


@pytest.mark.distributed
def test_a_rank_that_stops_answering_mid_check_is_named_at_that_collective():
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
               "WORLD_SIZE": "2", "PYTHONWARNINGS": "ignore"}
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs.append(subprocess.Popen([sys.executable, "-c", STALL_SCRIPT], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT))
    outs = [p.communicate(timeout=120) for p in procs]
    rank0 = json.loads(outs[0][0].strip().splitlines()[-1])
    assert rank0["missing"] == [1], outs[0][1][-2000:]
    assert rank0["message"].startswith("all_gather of 4.0 KiB within 3s: rank(s) 1 did not answer")
