"""A whole training run on the (fake) NPU: `python train.py` with TITAN_DEVICE=npu selects hccl, applies the HCCL
environment before torch imports torch_npu, binds LOCAL_RANK's card, routes every op to the torch_npu kernels and
trains exactly like the CPU run of the same config.

The fake is installed there with the pinned wheel's dist-info, so `import torch` imports it through the wheel's
torch.backends entry point, as it imports the real package.

The fake's "npu" tensors live in CPU memory (FAKE_NPU_TENSORS=1). Registering that device renames torch's
PrivateUse1 backend, which no process can undo, so the runs are subprocesses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_npu.models.llama import Transformer
from titan_npu.models.llama.args import LlamaArgs
from titan_npu.ops import set_kernels

REPO = Path(__file__).resolve().parents[2]
FAKE_DIR = Path(__file__).resolve().parent / "fake_torch_npu"
N_LAYERS, STEPS = 2, 3
TINY = [
    "--config", str(REPO / "configs" / "debug.toml"),
    "--model.dim", "64", "--model.n_layers", str(N_LAYERS), "--model.n_heads", "4", "--model.n_kv_heads", "2",
    "--model.max_seq_len", "64", "--training.seq_len", "64", "--training.batch_size", "2",
    "--training.max_steps", str(STEPS), "--metrics.log_interval", "1", "--checkpoint.enable", "false",
    "--metrics.report", "false", "--metrics.progress", "lines",
]
# Variables of the NPU runtime and this run's settings: none may come from the calling environment.
RUN_VARS = ("HCCL_", "TORCH_HCCL_", "PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "GLOO_SOCKET_IFNAME",
            "TITAN_DEVICE", "ASCEND_RT_VISIBLE_DEVICES", "TASK_QUEUE_ENABLE", "CPU_AFFINITY_CONF",
            "CLOSE_MATMUL_K_SHIFT")


def start_training(log_dir: Path, extra_env: dict[str, str], *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(RUN_VARS)}
    env.update(extra_env)
    return subprocess.Popen([sys.executable, str(REPO / "train.py"), *TINY, "--metrics.log_dir", str(log_dir), *args],
                            env=env, cwd=log_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return out


def losses(log_dir: Path) -> list[float]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if '"loss"' in line]


@pytest.fixture(scope="module")
def npu_and_cpu_runs(tmp_path_factory, torch_npu_wheel):
    """The same tiny run on the fake NPU (card 1 of two visible ones) and on the CPU."""
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("a real torch_npu is installed; the fake would shadow it")
    root = tmp_path_factory.mktemp("npu_training")
    report = root / "torch_npu_report.json"
    site = root / "site"
    torch_npu_wheel.PINNED.write_dist_info(site)  # the fake installed: torch imports it by its entry point
    npu = start_training(root / "npu", {
        "PYTHONPATH": os.pathsep.join([str(FAKE_DIR), str(site), os.environ.get("PYTHONPATH", "")]),
        "FAKE_NPU_TENSORS": "1", "FAKE_TORCH_NPU_REPORT": str(report), "TITAN_DEVICE": "npu",
        "ASCEND_RT_VISIBLE_DEVICES": "4,6", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "1",
        "HCCL_EXEC_TIMEOUT": "77",
    }, "--comm.init_timeout_s", "600", "--comm.hccl_buffsize_mb", "200", "--comm.socket_ifname", "eth0",
        "--training.memory_fraction", "0.9")
    cpu = start_training(root / "cpu", {"TITAN_DEVICE": "cpu"})
    npu_out, cpu_out = finish(npu), finish(cpu)
    return npu_out, cpu_out, json.loads(report.read_text()), root


def test_training_on_the_npu_uses_hccl_and_the_npu_kernels(npu_and_cpu_runs):
    npu_out = npu_and_cpu_runs[0]
    assert "on npu (Ascend910B3, backend hccl)" in npu_out
    assert "kernels: attention=npu, rms_norm=npu, apply_rotary_emb=npu, swiglu=npu" in npu_out


def test_every_op_of_every_step_ran_a_torch_npu_kernel(npu_and_cpu_runs):
    calls = npu_and_cpu_runs[2]["calls"]
    assert calls == {
        "npu_fusion_attention": N_LAYERS * STEPS,
        "npu_rms_norm": (2 * N_LAYERS + 1) * STEPS,  # two per block and the final norm
        "npu_rotary_mul": 2 * N_LAYERS * STEPS,  # q and k
        "npu_swiglu": N_LAYERS * STEPS,
        "_fused_adamw_": 2 * STEPS,  # torch's fused AdamW (a call per parameter group), on torch_npu's kernel
    }


def test_the_npu_run_sets_the_hccl_environment_unless_the_user_did(npu_and_cpu_runs):
    env = npu_and_cpu_runs[2]["env"]
    assert env["HCCL_CONNECT_TIMEOUT"] == "600"
    assert env["HCCL_EXEC_TIMEOUT"] == "77"  # the environment's value wins over [comm]
    assert env["HCCL_BUFFSIZE"] == "200"
    assert env["HCCL_SOCKET_IFNAME"] == "eth0"
    assert env["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"


def test_torch_imports_torch_npu_by_its_entry_point_after_train_py_set_what_torch_npu_reads_at_import(
        npu_and_cpu_runs):
    events = npu_and_cpu_runs[2]["events"]
    # "autoload": torch called the wheel's torch.backends entry point, i.e. `import torch` imported the package
    assert [what for what, _ in events] == ["import", "autoload", "set_device"]
    import_env = events[0][1]
    # read at import (torch_npu/_init/core/optional_features.py): the flight recorder's buffer, from
    # reliability.flight_recorder_size, and the task-queue level, from training.npu_task_queue
    assert import_env.get("TORCH_HCCL_TRACE_BUFFER_SIZE") == "2000"
    assert import_env.get("TASK_QUEUE_ENABLE") == "1"
    # the config was read before torch: --comm.init_timeout_s 600 of the command line is already in place
    assert import_env.get("HCCL_CONNECT_TIMEOUT") == "600" and import_env.get("HCCL_BUFFSIZE") == "200"


def test_the_allocator_variable_is_in_place_before_torch_npu_is_imported_and_the_card_bound(npu_and_cpu_runs):
    events = npu_and_cpu_runs[2]["events"]
    assert all(env["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True" for _, env in events)


def test_the_standard_ascend_launch_environment_is_in_place_before_torch_npu_starts(npu_and_cpu_runs):
    import_env = npu_and_cpu_runs[2]["events"][0][1]
    assert {k: import_env.get(k) for k in ("TASK_QUEUE_ENABLE", "CPU_AFFINITY_CONF", "TORCH_HCCL_ENABLE_MONITORING",
                                           "TORCH_HCCL_DUMP_ON_TIMEOUT")} == {
        "TASK_QUEUE_ENABLE": "1", "CPU_AFFINITY_CONF": "1", "TORCH_HCCL_ENABLE_MONITORING": "1",
        "TORCH_HCCL_DUMP_ON_TIMEOUT": "1"}


def test_the_npu_run_binds_local_rank_caps_memory_and_empties_the_cache_after_loading(npu_and_cpu_runs):
    report = npu_and_cpu_runs[2]
    assert report["set_device_calls"] == [1]
    assert report["memory_fraction"] == {"1": 0.9}
    assert report["empty_cache_calls"] >= 1


def test_the_npu_run_trains_like_the_cpu_run(npu_and_cpu_runs):
    root = npu_and_cpu_runs[3]
    npu_losses, cpu_losses = losses(root / "npu"), losses(root / "cpu")
    assert len(npu_losses) == STEPS
    torch.testing.assert_close(npu_losses, cpu_losses, atol=1e-5, rtol=1e-5)


def test_op_check_runs_every_kernel_the_training_run_calls(npu_and_cpu_runs, tmp_path):
    report = tmp_path / "op_check.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(RUN_VARS)}
    env.update(PYTHONPATH=os.pathsep.join([str(FAKE_DIR), os.environ.get("PYTHONPATH", "")]), FAKE_NPU_TENSORS="1",
               TITAN_DEVICE="npu", FAKE_TORCH_NPU_REPORT=str(report))
    out = subprocess.run([sys.executable, str(REPO / "examples" / "op_check.py"), "--quick"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "op check: PASS" in out.stdout, out.stdout + out.stderr
    checked, trained = set(json.loads(report.read_text())["calls"]), set(npu_and_cpu_runs[2]["calls"])
    assert checked >= trained, f"op_check.py does not check {sorted(trained - checked)}"
    # Beyond a dense one-process run: ring attention's block kernel (context parallelism), the MoE kernels and
    # DeepSeek Sparse Attention's.
    assert checked - trained == {"npu_fusion_attention_grad", "npu_grouped_matmul", "npu_grouped_matmul_add_",
                                 "npu_moe_gating_top_k_softmax", "npu_moe_token_permute",
                                 "npu_moe_token_unpermute", "npu_lightning_indexer", "npu_sparse_flash_attention",
                                 "npu_sparse_flash_attention_grad", "npu_dense_lightning_indexer_softmax_lse",
                                 "npu_dense_lightning_indexer_grad_kl_loss"}, sorted(checked - trained)


def test_use_flash_attention_false_keeps_the_eager_attention_and_fuses_the_rest(fake_torch_npu):
    # In-process: CPU tensors stand in for the NPU, with the npu kernels selected by name.
    torch.manual_seed(0)
    args = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48, max_seq_len=16,
                     use_flash_attention=False)
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, 64, (2, 16))
    set_kernels("npu")
    fake_torch_npu.calls.clear()
    eager_fused = model(tokens)
    assert fake_torch_npu.calls["npu_fusion_attention"] == 0
    assert fake_torch_npu.calls["npu_rms_norm"] == 5 and fake_torch_npu.calls["npu_swiglu"] == 2
    set_kernels("reference")
    torch.testing.assert_close(eager_fused, model(tokens), atol=1e-5, rtol=1e-5)


def test_qwen3_q_k_norms_and_qwen2_biases_run_on_the_npu_kernels(fake_torch_npu):
    from titan_npu.models.decoder.args import DecoderArgs

    torch.manual_seed(0)
    common = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48, max_seq_len=16)
    tokens = torch.randint(0, 64, (2, 16))
    for args, norms in ((DecoderArgs(**common, head_dim=16, qk_norm=True, tie_embeddings=True), 9),
                        (DecoderArgs(**common, qkv_bias=True), 5)):
        model = Transformer(args)
        model.init_weights()
        set_kernels("npu")
        fake_torch_npu.calls.clear()
        fused = model(tokens)
        # 2 norms per block + the final one, and Qwen3's q/k norms (2 per block) on npu_rms_norm too.
        assert fake_torch_npu.calls["npu_rms_norm"] == norms
        assert fake_torch_npu.calls["npu_fusion_attention"] == 2
        set_kernels("reference")
        torch.testing.assert_close(fused, model(tokens), atol=1e-5, rtol=1e-5)
