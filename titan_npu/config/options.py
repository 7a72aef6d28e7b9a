"""Every user-facing knob in one table: each config key and each command-line option of every command, with its
type and the values it accepts.

The config's validation (validate.py) and the commands' option check (check_options) both read these rows, so a
range is written once; tests/config/test_options_table.py holds every schema key and every argparse option of every
command to having a row here, and feeds each row a value just outside what it accepts.

Adding a knob: a config key gets a row in CONFIG_KEYS under "section.key" (its type is the schema's); a command
option gets a row in COMMAND_OPTIONS[command] under its first flag (or its dest, for a positional), with the type
argparse parses it as. A row without a range or choices says the value is free (a path, a name, a switch). A
[model] key other than the shared ones of config/schema.py is a family's own: its row is declared in the family's
folder (ModelSpec.model_keys) and model_key_rows() gathers them. The rows' classes are titan_npu/knobs.py's.
"""

from __future__ import annotations

import functools

from titan_npu.knobs import Knob, Range, above, at_least, between

FREE = Knob()  # a path, a name or a switch: any value of its type
_COUNT = Knob(at_least(0), why="0 = none")
_NOT_SPLIT = Knob(at_least(1), why="1 = this dimension is not split")

DECAY_TYPES = ("cosine", "linear", "constant", "wsd")
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
AC_MODES = ("none", "selective", "full")
BACKENDS = ("auto", "hccl", "nccl", "gloo")
CP_MODES = ("ring", "ulysses", "hybrid")  # parallel/layout.py says which of them run yet
OPTIMIZERS = ("AdamW", "Adam", "SGD", "Muon")
MUON_ADJUST_LR = ("match_rms_adamw", "original", "none")
MUON_NS_DTYPES = ("bf16", "fp32")
OPTIMIZER_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")
STATE_DTYPES = ("fp32", "bf16")
PROGRESS_STYLES = ("auto", "bar", "lines")
PROFILER_LEVELS = ("Level0", "Level1", "Level2")
ATTENTION_BACKENDS = ("auto", "cudnn", "flash", "efficient")
DATA_FORMATS = ("text", "chat", "instruction")
OVERLONG_RULES = ("truncate", "drop")
FLOAT8_RECIPES = ("tensorwise", "rowwise")
FLOAT8_MOE_RECIPES = ("rowwise", "mxfp8")

# Config keys: "section.key" -> row. model.name, model.flavor, the dtypes and checkpoint.resume are free here:
# validate.py checks them against the registry, the dtype spellings and the forms a resume takes. The other [model]
# keys are a family's own: their rows are declared in its folder (ModelSpec.model_keys) and read by model_key_rows().
CONFIG_KEYS: dict[str, Knob] = {
    "model.name": FREE,
    "model.flavor": FREE,
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
    "optimizer.state_dtype": Knob(choices=STATE_DTYPES, what="optimizer state dtype"),
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
    "parallel.pp_virtual_stages": Knob(at_least(0), why="0 = 2 for the interleaved and V schedules, else 1"),
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
    "activation_checkpoint.offload": FREE,
    "activation_checkpoint.offload_min_bytes": Knob(at_least(0), why="0 offloads every saved activation; 1 MiB "
                                                    "keeps the small ones on the device"),
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
    "checkpoint.convert_optimizer_state": FREE,
    "checkpoint.enable": FREE,
    "checkpoint.overwrite": FREE,
    "data.path": FREE,
    "data.sources": FREE,  # each source's weight, name and max_epochs: config/mixture.py check_sources
    "data.tokenizer": Knob(nonempty=True, why="use byte, a tokenizer.json/.model or its directory"),
    "data.num_workers": Knob(at_least(0), why="0 = load in the training process",
                             most=(256, "more loader processes than a host has cores: 2-8 are usual")),
    "data.text_field": Knob(nonempty=True, why="the field of .jsonl records that holds the text, e.g. text"),
    "data.val_fraction": Knob(between(0, 1, high_open=True), why="the share of documents held out"),
    "data.document_mask": FREE,
    "data.reset_position_ids": FREE,
    "data.format": Knob(choices=DATA_FORMATS, what="data format"),
    "data.chat_template": FREE,
    "data.messages_field": Knob(nonempty=True, why="the field of chat records that holds the messages"),
    "data.prompt_field": Knob(nonempty=True, why="the field of instruction records that holds the prompt"),
    "data.response_field": Knob(nonempty=True, why="the field of instruction records that holds the response"),
    "data.system_field": Knob(nonempty=True, why="the field of instruction records that holds a system prompt"),
    "data.pack": FREE,
    "data.overlong": Knob(choices=OVERLONG_RULES, what="rule for conversations longer than seq_len"),
    "data.skip_bad_records": FREE,
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
    "lora.enable": FREE,
    "lora.rank": Knob(at_least(1), why="8 or 16 are usual"),
    "lora.alpha": Knob(above(0), why="usually rank or 2 x rank"),
    "lora.dropout": Knob(between(0, 1, high_open=True), why="a probability; 0 = none, 0.05 is usual"),
    "lora.use_rslora": FREE,
    "lora.target_modules": FREE,  # validate.py refuses an empty list; the model refuses a pattern matching nothing
    "lora.experts": FREE,  # validate.py refuses it: routed experts take no adapters yet
}



@functools.cache
def model_key_rows() -> dict[str, dict[str, Knob]]:
    """'model.<key>' -> {family: its row} for every family's own [model] keys (models/registry.py; imports torch).
    A row's `kind` is the key's type (a value unset is None: the flavor's)."""
    from titan_npu.models.registry import SPECS

    rows: dict[str, dict[str, Knob]] = {}
    for spec in SPECS.values():
        for key, knob in spec.model_keys.items():
            rows.setdefault(f"model.{key}", {})[spec.name] = knob
    return rows


def family_key_rows(family: str) -> dict[str, Knob]:
    """The rows of one family's own [model] keys, 'model.<key>' -> row, in the family's order."""
    from titan_npu.models.registry import get_spec

    return {f"model.{key}": knob for key, knob in get_spec(family).model_keys.items()}


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
        "--workers": Knob(at_least(1), kind=int, why="tokenising processes",
                          most=(1024, "more tokenising processes than a host has cores")),
        "--text-field": Knob(nonempty=True, kind=str, why="the field of .jsonl records that holds the text"),
        "--doc-sep": Knob(choices=("blank", "line"), kind=str),
        "--format": Knob(choices=("bin", "jsonl", "chat", "instruction"), kind=str),
        "--chat-template": _STR,
        "--messages-field": Knob(nonempty=True, kind=str, why="the field of chat records that holds the messages"),
        "--prompt-field": Knob(nonempty=True, kind=str, why="the field of instruction records that holds the prompt"),
        "--response-field": Knob(nonempty=True, kind=str, why="the field of instruction records with the response"),
        "--system-field": Knob(nonempty=True, kind=str, why="the field of instruction records with a system prompt"),
        "--max-seq-len": Knob(at_least(0), kind=int, why="0 = keep whole documents"),
        "--skip-bad-records": _SWITCH,
        "--shard-size": Knob(at_least(1), kind=int, why="tokens per shard"),
        "--progress": Knob(choices=PROGRESS_STYLES, kind=str), **_DEBUG,
    },
    "train-tokenizer": {
        "inputs": _STR, "--vocab-size": Knob(at_least(259), kind=int, why="256 bytes, 3 specials and the merges",
                                               most=(16_777_216, "2**24; published vocabularies hold 32K-256K")),
        "--output": _STR, "--text-field": Knob(nonempty=True, kind=str, why="the field that holds the text"),
        "--doc-sep": Knob(choices=("blank", "line"), kind=str), "--skip-bad-records": _SWITCH, **_DEBUG,
    },
    "export": {
        "--checkpoint": _STR, "--step": Knob(at_least(0), kind=int, why="a step number of --checkpoint"),
        "--format": Knob(choices=("pt", "hf", "peft"), kind=str),
        "--dtype": Knob(choices=("bf16", "fp16", "fp32"), kind=str),
        "--output": _STR, "--max-shard-size": _STR, "--overwrite": _SWITCH, "--tokenizer": _STR, "--merge": _SWITCH,
        **_DEBUG,
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
        "--chat": _SWITCH, "--system": _STR, "--chat-template": _STR,
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
