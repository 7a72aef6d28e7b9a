"""`titan-npu generate --chat`: `python train.py --config configs/sft_debug.toml` trains, its export answers through
the chat template (one --prompt, or a conversation read from stdin), and decoding stops at the template's end of
turn."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_npu.cli import main as cli_main
from titan_npu.models.llama import LlamaArgs, Transformer
from titan_npu.tools.generate import generate

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sft_export(tmp_path_factory):
    """configs/sft_debug.toml trained for 4 steps in a fresh process (its packing counted in run_info.json and the
    report), exported as a .pt file; (export, run folder)."""
    run = tmp_path_factory.mktemp("sft")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "TORCHELASTIC_", "TITAN_FAULT_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env.update(TITAN_DEVICE="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "train.py", "--config", "configs/sft_debug.toml",
                             "--training.max_steps", "4", "--checkpoint.save_interval", "4",
                             "--checkpoint_dir", str(run / "ckpt"), "--log_dir", str(run / "logs")],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "conversations in" in result.stderr + result.stdout and "[Step 4]" in result.stderr + result.stdout
    counts = json.loads((run / "logs" / "run_info.json").read_text())["conversations"]["builtin"]
    assert counts["conversations"] + counts["dropped"] == 320 and counts["windows"] < 320  # packed, all accounted
    assert "## Chat data" in (run / "logs" / "report.md").read_text()
    export = run / "model.pt"
    assert cli_main(["export", "--checkpoint", str(run / "ckpt"), "--output", str(export), "--dtype", "fp32"]) == 0
    return export, run


def test_sft_debug_trains_and_its_export_answers_a_chat_prompt(sft_export, capsys):
    export, run = sft_export
    capsys.readouterr()
    rc = cli_main(["generate", "--chat", "--checkpoint", str(export), "--config", str(run / "logs" / "config.toml"),
                   "--prompt", "What is 2 plus 3?", "--max-new-tokens", "24", "--seed", "0"])
    out = capsys.readouterr().out
    assert rc == 0 and out.strip(), out
    assert "<|assistant|>" not in out and "What is 2 plus 3?" not in out  # the reply alone, not the rendered prompt


def test_chat_reads_a_multi_turn_conversation_from_stdin(sft_export, capsys, monkeypatch):
    export, run = sft_export
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 1 plus 1?\nSpell apple backwards.\n\n"))
    capsys.readouterr()
    rc = cli_main(["generate", "--chat", "--checkpoint", str(export), "--config", str(run / "logs" / "config.toml"),
                   "--system", "Be brief.", "--max-new-tokens", "8", "--temperature", "0"])
    out = capsys.readouterr().out
    assert rc == 0 and len(out.splitlines()) >= 2, out  # one reply per user line


def test_decoding_stops_at_the_end_of_turn_token():
    torch.manual_seed(0)
    model = Transformer(LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=64,
                                  max_seq_len=64, family="llama3", flavor="test"))
    model.init_weights()
    model.eval()
    free = generate(model, [1, 2, 3], 12, temperature=0)[0]
    stop = free[4]
    first = free.index(stop)
    assert generate(model, [1, 2, 3], 12, temperature=0, stop_ids=(stop,))[0] == free[:first]
