"""Every user-facing knob in one table: each config key and each command-line option of every command, with its
type and the values it accepts.

The config's validation (validate.py) and the commands' option check (check_options) both read these rows, so a
range is written once; tests/config/test_options_table.py holds every schema key and every argparse option of every
command to having a row here, and feeds each row a value just outside what it accepts.

Adding a knob: a config key gets a row in CONFIG_KEYS under "section.key" (its type is the schema's); a command
option gets a row in COMMAND_OPTIONS[command] under its first flag (or its dest, for a positional), with the type
argparse parses it as. A row without a range or choices says the value is free (a path, a name, a switch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from titan_npu.config.coerce import show
from titan_npu.errors import ConfigError


def _num(x: float) -> str:
    return f"{x:g}"


@dataclass(frozen=True)
class Range:
    """An interval of numbers (either end open or absent), plus single values allowed outside it (0 = off)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # > low rather than >= low
    high_open: bool = False  # < high rather than <= high
    also: tuple[tuple[float, str], ...] = ()  # (value, what it means) accepted besides the interval

    def allows(self, value: float) -> bool:
        """True when `value` is in the interval or one of the extra values; never NaN or an infinity (a command's
        float option parses them, the config's keys already refuse them)."""
        if any(value == v for v, _ in self.also):
            return True
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"in {left}{_num(self.low)}, {_num(self.high)}{right}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {_num(self.low)}"
        elif self.high is not None:
            text = f"{'<' if self.high_open else '<='} {_num(self.high)}"
        else:
            text = "a number"
        extra = [f"{_num(v)} ({meaning})" if meaning else _num(v) for v, meaning in self.also]
        return " or ".join([*extra, text])

    def just_outside(self, kind: type) -> list[float]:
        """The nearest refused value past each finite end (ints step by 1, floats by one ulp), stepping over an
        extra value that lies next to an end (dp_shard's -1 below 1)."""
        def step(x: float, direction: float) -> float:
            return x + direction if kind is int else math.nextafter(x, direction * math.inf)

        out = []
        for end, is_open, direction in ((self.low, self.low_open, -1), (self.high, self.high_open, 1)):
            if end is None:
                continue
            value = kind(end) if is_open else step(kind(end), direction)
            while self.allows(value):
                value = step(value, direction)
            out.append(value)
        return out


def at_least(low: float, *also: tuple[float, str]) -> Range:
    """>= low (or one of `also`)."""
    return Range(low=low, also=also)


def above(low: float) -> Range:
    """> low."""
    return Range(low=low, low_open=True)


def between(low: float, high: float, low_open: bool = False, high_open: bool = False) -> Range:
    """low..high, either end open."""
    return Range(low=low, high=high, low_open=low_open, high_open=high_open)


@dataclass(frozen=True)
class Knob:
    """One row of the table: what a value may be. `kind` is the type a command option is parsed as (a config key's
    type is its schema field's); `each` checks every item of a list value."""

    range: Range | None = None
    choices: tuple[str, ...] = ()
    why: str = ""
    kind: type | None = None
    each: bool = False
    nonempty: bool = False  # a string that must hold something
    most: tuple[float, str] | None = None  # (a documented maximum, what it is): a larger number is refused
    what: str = "value"  # choices: what the value is ("decay type") in the refusal

    def check(self, name: str, value: Any) -> Any:
        """`value` (choices: in their canonical spelling), or a ConfigError naming `name`, the value and what is
        allowed."""
        if value is None:
            return value  # optional, not given
        shown = show(value)
        hint = f" ({self.why})" if self.why else ""
        if self.choices:
            if self.each and isinstance(value, list):
                return [self._choice(name, item, f"{name} item {show(item)}") for item in value]
            return self._choice(name, value, f"{name} = {shown}")
        if self.nonempty and not str(value).strip():
            raise option_error(name, f"{name} is empty{hint}")
        if self.range is not None:
            for item in (value if self.each else [value]):
                if isinstance(item, (int, float)) and not isinstance(item, bool) and not self.range.allows(item):
                    finite = "" if math.isfinite(item) else "a finite number "
                    raise option_error(name, f"{name} = {shown} must be {finite}{self.range}{hint}")
                if self.most is not None and isinstance(item, (int, float)) and item > self.most[0]:
                    raise option_error(name, f"{name} = {shown} is above {self.most[0]:,}, {self.most[1]}")
        return value

    def _choice(self, name: str, value: Any, shown: str) -> str:
        for choice in self.choices:
            if str(value).strip().lower() == choice.lower():
                return choice
        raise option_error(name, f"{shown} is not a known {self.what} (use {or_list(self.choices)})")


def option_error(name: str, message: str) -> ConfigError:
    """A ConfigError that remembers which key or option it is about (the loader names the file line that set it)."""
    error = ConfigError(message)
    error.key = name  # type: ignore[attr-defined]
    return error


def or_list(choices: tuple[str, ...] | list[str]) -> str:
    """'a, b or c'."""
    return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]


FREE = Knob()  # a path, a name or a switch: any value of its type
_FLAVOR = "leave it out to take the flavor's value"
_SIZE = Knob(above(0), why=_FLAVOR)
_COUNT = Knob(at_least(0), why="0 = none")
_NOT_SPLIT = Knob(at_least(1), why="1 = this dimension is not split")

DECAY_TYPES = ("cosine", "linear", "constant", "wsd")
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
AC_MODES = ("none", "selective", "full")
BACKENDS = ("auto", "hccl", "nccl", "gloo")
CP_MODES = ("ring", "ulysses", "hybrid")  # parallel/layout.py says which of them run yet
OPTIMIZERS = ("AdamW", "Adam", "SGD", "Muon")
MUON_ADJUST_LR = ("match_rms_adamw", "original", "none")
MUON_NS_DTYPES = ("bf16", "fp32")
OPTIMIZER_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")
PROGRESS_STYLES = ("auto", "bar", "lines")
PROFILER_LEVELS = ("Level0", "Level1", "Level2")
ATTENTION_BACKENDS = ("auto", "cudnn", "flash", "efficient")
FLOAT8_RECIPES = ("tensorwise", "rowwise")
FLOAT8_MOE_RECIPES = ("rowwise", "mxfp8")

# Config keys: "section.key" -> row. model.name, model.flavor, the dtypes and checkpoint.resume are free here:
# validate.py checks them against the registry, the dtype spellings and the forms a resume takes.
CONFIG_KEYS: dict[str, Knob] = {
    "model.name": FREE,
    "model.flavor": FREE,
    **{f"model.{key}": _SIZE for key in (
        "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ffn_dim", "ffn_dim_multiplier",
        "multiple_of", "norm_eps", "rope_theta", "max_seq_len", "n_experts", "top_k", "moe_ffn_dim",
        "decoder_sparse_step", "kv_lora_rank", "v_head_dim", "n_groups", "topk_groups", "route_scale",
        "yarn_original_seq_len", "sliding_window", "swiglu_limit", "full_attention_interval", "linear_n_k_heads",
        "linear_n_v_heads", "linear_k_head_dim", "linear_v_head_dim", "linear_conv_kernel")},
    "model.layer_types": Knob(choices=("sliding_attention", "full_attention", "linear_attention"),
                              what="attention layer type", each=True),
    "model.partial_rotary_factor": Knob(between(0, 1, low_open=True), why="the share of each head RoPE rotates"),
    "model.variant": Knob(choices=("qwen3_next", "qwen3_5"), what="Hugging Face layout"),
    "model.yarn_truncate": FREE,
    "model.rope_scaling_factor": Knob(at_least(0), why="0 or unset turns it off"),
    "model.qkv_bias": FREE,
    "model.qk_norm": FREE,
    "model.tie_embeddings": FREE,
    "model.norm_topk_prob": FREE,
    "model.mlp_only_layers": Knob(at_least(0), why="layer ids count from 0", each=True),
    **{f"model.{key}": Knob(at_least(0), why="0 = off") for key in (
        "router_aux_loss_coef", "capacity_factor", "shared_ffn_dim", "q_lora_rank", "n_shared_experts",
        "first_k_dense", "score_bias_rate", "seq_aux_loss_coef", "mtp_depth", "yarn_factor", "mtp_loss_coef")},
    **{f"model.{key}": Knob(at_least(0), why=_FLAVOR) for key in (
        "qk_nope_head_dim", "qk_rope_head_dim", "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale",
        "yarn_mscale_all_dim")},
    "model.use_flash_attention": FREE,
    "model.attention_backend": Knob(choices=ATTENTION_BACKENDS, what="attention kernel"),
    "model.rope_fp32": FREE,
    "training.batch_size": Knob(at_least(1), why="sequences per device per micro-step"),
    "training.seq_len": Knob(at_least(1), why="tokens per sequence"),
    "training.gradient_accumulation_steps": Knob(at_least(1), why="1 = no accumulation"),
    "training.max_steps": Knob(at_least(1), why="optimizer steps to run"),
    "training.dtype": FREE,
    "training.max_norm": Knob(at_least(0), why="the gradient-norm clipping threshold"),
    "training.seed": Knob(at_least(0), why="any whole number from 0; 42 is usual"),
    "training.deterministic": FREE,
    "training.loss_chunk_tokens": Knob(at_least(0), why="0 computes the whole logits at once"),
    "training.tf32": FREE,
    "training.memory_fraction": Knob(between(0, 1), why="a share of device memory; 0 = no cap"),
    "training.mixed_precision": FREE,
    "training.npu_task_queue": Knob(between(0, 2), why="torch_npu's task-queue level: 0 = off, 1 = training, "
                                    "2 = pure inference"),
    "optimizer.name": Knob(choices=OPTIMIZERS, what="optimizer"),
    "optimizer.lr": Knob(above(0), why="a typical peak learning rate is 3e-4"),
    "optimizer.betas": Knob(between(0, 1, high_open=True), why="two values; the usual choice is [0.9, 0.95]",
                            each=True),
    "optimizer.eps": Knob(above(0), why="1e-8 is usual"),
    "optimizer.weight_decay": Knob(at_least(0), why="0 turns weight decay off; 0.1 is typical"),
    "optimizer.implementation": Knob(choices=OPTIMIZER_IMPLEMENTATIONS, what="optimizer implementation"),
    "optimizer.muon_momentum": Knob(between(0, 1, high_open=True), why="0.95 is usual"),
    "optimizer.muon_nesterov": FREE,
    "optimizer.muon_ns_steps": Knob(at_least(1), why="5 Newton-Schulz iterations are usual"),
    "optimizer.muon_ns_coefficients": Knob(Range(), each=True,
                                           why="any real a, b, c; validate.py checks there are three"),
    "optimizer.muon_ns_dtype": Knob(choices=MUON_NS_DTYPES, what="Newton-Schulz dtype"),
    "optimizer.muon_adjust_lr": Knob(choices=MUON_ADJUST_LR, what="Muon lr adjustment"),
    "optimizer.muon_exclude": FREE,  # fnmatch patterns of parameter names kept on AdamW
    "lr_scheduler.warmup_steps": Knob(at_least(0), why="0 = no warmup"),
    "lr_scheduler.decay_type": Knob(choices=DECAY_TYPES, what="decay type"),
    "lr_scheduler.min_lr_ratio": Knob(between(0, 1), why="a fraction"),
    "lr_scheduler.decay_ratio": Knob(between(0, 1), why="a fraction"),
    "parallel.backend": Knob(choices=BACKENDS, what="backend"),
    "parallel.dp_replicate": _NOT_SPLIT,
    "parallel.dp_shard": Knob(at_least(1, (-1, "all remaining ranks"))),
    "parallel.fsdp": FREE,
    "parallel.tp_degree": _NOT_SPLIT,
    "parallel.pp_degree": _NOT_SPLIT,
    "parallel.pp_schedule": Knob(choices=PP_SCHEDULES, what="pipeline schedule"),
    "parallel.pp_microbatches": Knob(at_least(0), why="0 = pp_degree * 2"),
    "parallel.pp_virtual_stages": Knob(at_least(0), why="0 = 2 for Interleaved1F1B, else 1"),
    "parallel.cpu_offload": FREE,
    "parallel.reshard_after_forward": FREE,
    "parallel.loss_parallel": FREE,
    "parallel.cp_degree": _NOT_SPLIT,
    "parallel.cp_mode": Knob(choices=CP_MODES, what="context parallel mode"),
    "parallel.cp_ulysses_degree": _NOT_SPLIT,
    "parallel.ep_degree": _NOT_SPLIT,
    "activation_checkpoint.mode": Knob(choices=AC_MODES, what="activation checkpointing mode"),
    "activation_checkpoint.selective_every": Knob(at_least(1), why="1 = every block"),
    "activation_checkpoint.selective_ops": FREE,
    "compile.enable": FREE,
    "compile.backend": Knob(nonempty=True, why="inductor is the usual torch.compile backend"),
    "checkpoint.dir": Knob(nonempty=True, why="give a directory, e.g. checkpoints"),
    "checkpoint.save_interval": Knob(at_least(1), why="steps between checkpoints"),
    "checkpoint.keep_last_n": Knob(at_least(1), why="how many recent checkpoints stay on disk"),
    "checkpoint.async_save": FREE,
    "checkpoint.resume": FREE,
    "checkpoint.export_dtype": FREE,
    "checkpoint.initial_load": FREE,
    "checkpoint.initial_load_model_only": FREE,
    "checkpoint.allow_model_change": FREE,
    "checkpoint.enable": FREE,
    "checkpoint.overwrite": FREE,
    "data.path": FREE,
    "data.sources": FREE,  # each source's weight, name and max_epochs: config/mixture.py check_sources
    "data.tokenizer": Knob(nonempty=True, why="use byte, a tokenizer.json/.model or its directory"),
    "data.num_workers": Knob(at_least(0), why="0 = load in the training process"),
    "data.text_field": Knob(nonempty=True, why="the field of .jsonl records that holds the text, e.g. text"),
    "data.val_fraction": Knob(between(0, 1, high_open=True), why="the share of documents held out"),
    "data.document_mask": FREE,
    "data.reset_position_ids": FREE,
    "metrics.log_dir": Knob(nonempty=True, why="give a directory, e.g. logs"),
    "metrics.log_interval": Knob(at_least(1), why="steps between log lines"),
    "metrics.tensorboard": FREE,
    "metrics.wandb": FREE,
    "metrics.peak_tflops": Knob(at_least(0), why="0 = detect from the device"),
    "metrics.progress": Knob(choices=PROGRESS_STYLES, what="progress style"),
    "metrics.spike_sigma": Knob(at_least(0), why="standard deviations above the recent loss; 4 is usual"),
    "metrics.spike_window": Knob(at_least(1), why="steps of recent loss the spike check looks at"),
    "metrics.report": FREE,
    "validation.enable": FREE,
    "validation.interval": Knob(at_least(1), why="steps between validations"),
    "validation.steps": Knob(at_least(1), why="batches per validation"),
    "validation.data": FREE,
    "eval.enable": FREE,
    "eval.tasks": FREE,  # names; checked against lm_eval's tasks when the run starts (titan_npu/eval/harness.py)
    "eval.interval": Knob(at_least(1), why="steps between evaluations"),
    "eval.limit": Knob(at_least(0), why="examples per task; 0 = all"),
    "eval.num_fewshot": Knob(at_least(0, (-1, "the task's own")), why="examples in each prompt"),
    "eval.batch_size": Knob(at_least(1), why="requests per forward"),
    "profiling.enable": FREE,
    "profiling.start_step": Knob(at_least(0), why="the step the trace starts at"),
    "profiling.active_steps": Knob(at_least(1), why="steps recorded in the trace"),
    "profiling.trace_dir": Knob(nonempty=True, why="give a directory, e.g. profile"),
    "profiling.record_shapes": FREE,
    "profiling.profile_memory": FREE,
    "profiling.ranks": Knob(at_least(0, (-1, "every rank")), why="ranks count from 0; [] = every rank", each=True),
    "profiling.level": Knob(choices=PROFILER_LEVELS, what="profiler level"),
    "profiling.with_stack": FREE,
    "float8.enable": FREE,
    "float8.recipe": Knob(choices=FLOAT8_RECIPES, what="float8 recipe"),
    "float8.emulate": FREE,
    "float8.filter_fqns": FREE,  # module names; validate.py refuses an empty one (it would match every linear)
    "float8.auto_filter_small_kn": FREE,
    "float8.fsdp_float8_all_gather": FREE,
    "float8.moe_experts": FREE,  # validate.py refuses it without float8.enable, and the recipes a setup lacks
    "float8.moe_recipe": Knob(choices=FLOAT8_MOE_RECIPES, what="float8 MoE recipe"),
    "comm.init_timeout_s": Knob(at_least(1), why="seconds to wait for all ranks to join"),
    "comm.join_timeout_s": Knob(at_least(1), why="seconds every rank has to reach the process group"),
    "comm.timeout_s": Knob(at_least(1), why="seconds a collective may take"),
    "comm.hccl_buffsize_mb": Knob(at_least(0), why="0 = keep HCCL_BUFFSIZE from the environment"),
    "comm.hccl_if_base_port": Knob(Range(1, 65535, also=((0, "keep the environment's"),)), why="a port"),
    "comm.socket_ifname": FREE,
    "reliability.skip_nonfinite": FREE,
    "reliability.max_skipped_steps": Knob(at_least(1), why="consecutive skipped updates before the run stops; 10 is "
                                      "usual, or set reliability.skip_nonfinite = false to turn skipping off"),
    "reliability.spike_skip_sigma": Knob(at_least(0), why="0 = off; 6 skips only clear spikes"),
    "reliability.handle_signals": FREE,
    "reliability.watchdog": FREE,
    "reliability.watchdog_timeout_s": Knob(at_least(0), why="0 = comm.timeout_s; set reliability.watchdog = false "
                                       "to turn the watchdog off"),
    "reliability.watchdog_step_factor": Knob(at_least(2, (0, "off")), why="a step this many times slower than the "
                                         "median counts as hung; 20 is a safe choice"),
    "reliability.flight_recorder_size": Knob(at_least(0), why="0 = off; 2000 is usual"),
    "reliability.disk_margin": Knob(at_least(1), why="free space needed as a multiple of one checkpoint's size; "
                                "1.1 is usual"),
    "fault_tolerance.enable": FREE,
    "fault_tolerance.replica_id": Knob(at_least(0), why="replica groups count from 0"),
    "fault_tolerance.num_replica_groups": Knob(at_least(1), why="replica groups of the job"),
    "fault_tolerance.lighthouse": FREE,
    "fault_tolerance.min_replicas": Knob(at_least(1), why="replica groups a step needs to commit"),
    "fault_tolerance.timeout_s": Knob(at_least(1), why="seconds a collective or weight transfer between groups may "
                                  "take"),
    "fault_tolerance.quorum_timeout_s": Knob(at_least(1), why="seconds a step waits for the replica set"),
    "fault_tolerance.connect_timeout_s": Knob(at_least(1), why="seconds to reach the lighthouse and the peers"),
    "fault_tolerance.hostname": FREE,
}

_STR, _SWITCH = Knob(kind=str), Knob(kind=bool)
# The largest job the planner searches (docs/planning.md): 65,536 nodes of up to 1,024 devices (a super-node such as
# a CloudMatrix 384 fits); beyond them its search would grow without a use, so the numbers are refused.
MAX_NODES, MAX_DEVICES_PER_NODE = 65_536, 1_024
_DEBUG = {"--debug": _SWITCH}

# Command options: command -> first flag (a positional's dest) -> row. kind: the type argparse parses it as
# (bool: a switch); choices given to argparse are listed here too and must match.
COMMAND_OPTIONS: dict[str, dict[str, Knob]] = {
    "train": {
        "--config": _STR, "--print_config": _SWITCH, **_DEBUG, "--dry-run": _SWITCH,
        "--world-size": Knob(at_least(1), kind=int, why="ranks of the job"),
        "--rank": Knob(at_least(0), kind=int, why="ranks count from 0"),
        "--device-type": _STR,
    },
    "prepare-data": {
        "inputs": _STR, "--output": _STR, "--tokenizer": _STR,
        "--workers": Knob(at_least(1), kind=int, why="tokenising processes"),
        "--text-field": Knob(nonempty=True, kind=str, why="the field of .jsonl records that holds the text"),
        "--doc-sep": Knob(choices=("blank", "line"), kind=str),
        "--format": Knob(choices=("bin", "jsonl"), kind=str),
        "--max-seq-len": Knob(at_least(0), kind=int, why="0 = keep whole documents"),
        "--skip-bad-records": _SWITCH,
        "--shard-size": Knob(at_least(1), kind=int, why="tokens per shard"),
        "--progress": Knob(choices=PROGRESS_STYLES, kind=str), **_DEBUG,
    },
    "train-tokenizer": {
        "inputs": _STR, "--vocab-size": Knob(at_least(259), kind=int, why="256 bytes, 3 specials and the merges"),
        "--output": _STR, "--text-field": Knob(nonempty=True, kind=str, why="the field that holds the text"),
        "--doc-sep": Knob(choices=("blank", "line"), kind=str), "--skip-bad-records": _SWITCH, **_DEBUG,
    },
    "export": {
        "--checkpoint": _STR, "--step": Knob(at_least(0), kind=int, why="a step number of --checkpoint"),
        "--format": Knob(choices=("pt", "hf"), kind=str), "--dtype": Knob(choices=("bf16", "fp16", "fp32"), kind=str),
        "--output": _STR, "--max-shard-size": _STR, "--overwrite": _SWITCH, "--tokenizer": _STR, **_DEBUG,
    },
    "import": {
        "--input": _STR, "--output": _STR, "--dtype": Knob(choices=("keep", "bf16", "fp16", "fp32"), kind=str),
        "--overwrite": _SWITCH, **_DEBUG,
    },
    "init-weights": {"--config": _STR, "--output": _STR, "--overwrite": _SWITCH, **_DEBUG},
    "plan": {
        "--config": _STR,
        "--nodes": Knob(at_least(1), kind=int, why="machines in the job",
                        most=(MAX_NODES, "the most nodes the planner plans (docs/planning.md)")),
        "--devices-per-node": Knob(at_least(1), kind=int, why="devices on each machine",
                                   most=(MAX_DEVICES_PER_NODE, "the most devices per node the planner plans")),
        "--device": _STR, "--device-memory": _STR,
        "--intra-node-bw": Knob(above(0), kind=float, why="GB/s"),
        "--inter-node-bw": Knob(above(0), kind=float, why="GB/s"),
        "--efficiency": Knob(between(0, 1, low_open=True), kind=float,
                             why="the default is the device type's, fitted on published runs"),
        "--reproduce": _STR,
        "--top": Knob(at_least(1), kind=int, why="how many layouts to list"),
        "--json": _SWITCH, "--verify": _SWITCH,
        "--rank": Knob(at_least(0), kind=int, why="ranks count from 0"), **_DEBUG,
    },
    "doctor": {
        "--config": _STR,
        "--timeout": Knob(above(0), kind=float, why="seconds; 60 is usual", most=(86400, "a day: check the value")),
        "--sizes": _STR,
        "--iters": Knob(at_least(1), kind=int, why="timed repetitions", most=(1000, "the most a check needs")),
        "--backend": _STR,
        "--no-collectives": _SWITCH, "--json": _SWITCH, **_DEBUG,
    },
    "generate": {
        "--checkpoint": _STR, "--config": _STR, "--prompt": _STR,
        "--max-new-tokens": Knob(at_least(1), kind=int, why="tokens to sample"),
        "--temperature": Knob(at_least(0), kind=float, why="0 = greedy"),
        "--top-k": Knob(at_least(0), kind=int, why="0 = all tokens"),
        "--top-p": Knob(between(0, 1, low_open=True), kind=float, why="1.0 = off"),
        "--num-samples": Knob(at_least(1), kind=int, why="continuations of the prompt"),
        "--seed": Knob(at_least(0), kind=int, why="any whole number from 0"),
        "--tokenizer": _STR, "--dtype": Knob(choices=("auto", "fp32", "bf16", "fp16"), kind=str), **_DEBUG,
    },
    "eval": {
        "--checkpoint": _STR, "--tasks": _STR, "--config": _STR, "--include-path": _STR, "--output": _STR,
        "--overwrite": _SWITCH, "--tokenizer": _STR,
        "--num-fewshot": Knob(at_least(0), kind=int, why="examples in each prompt"),
        "--limit": Knob(at_least(1), kind=int, why="examples of each task (leave it out for all)"),
        "--batch-size": Knob(at_least(1), kind=int, why="requests per forward"),
        "--dtype": Knob(choices=("auto", "fp32", "bf16"), kind=str), **_DEBUG,
    },
    "report": {"log_dir": _STR, "--out": _STR, "--no-plots": _SWITCH, **_DEBUG},
    "bench": {
        "--config": _STR, "--steps": Knob(at_least(1), kind=int, why="measured steps"),
        "--warmup": Knob(at_least(0), kind=int, why="3 is typical"), "--json": _SWITCH, **_DEBUG,
    },
}
