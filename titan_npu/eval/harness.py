"""Tasks for lm-evaluation-harness, found and checked before any model is loaded, and run offline.

The tasks that ship with titan-npu (titan_npu/eval/tasks/*.yaml, lm_eval's own task format over JSONL files beside
them) are found by name without --include-path; their data_files are resolved against the YAML's folder. Every
other name goes to lm_eval's TaskManager (its built-in tasks, plus the YAMLs of --include-path folders). Datasets are
read with HF_DATASETS_OFFLINE / HF_HUB_OFFLINE set: a dataset that is not on disk is refused, never downloaded.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from titan_npu.errors import ConfigError, DataError

SHIPPED_DIR = Path(__file__).resolve().parent / "tasks"
FEWSHOT_SEED = 1234  # lm_eval's own default (simple_evaluate's fewshot_random_seed)
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def shipped_tasks() -> dict[str, dict[str, Any]]:
    """The shipped tasks' configs by name, their data_files made absolute (lm_eval reads them from the cwd)."""
    found = {}
    for path in sorted(SHIPPED_DIR.glob("*.yaml")):
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
        files = config.get("dataset_kwargs", {}).get("data_files", {})
        config["dataset_kwargs"]["data_files"] = {split: str(path.parent / name) for split, name in files.items()}
        found[config["task"]] = config
    return found


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """HF_DATASETS_OFFLINE and HF_HUB_OFFLINE set for the block (and datasets' own switch, read at its import),
    datasets' progress bars off (titan-npu prints one line per task)."""
    saved = {k: os.environ.get(k) for k in OFFLINE_ENV}
    os.environ.update(OFFLINE_ENV)
    import datasets.config as hf_config
    from datasets.utils import logging as hf_logging

    saved_flag, bars = hf_config.HF_HUB_OFFLINE, hf_logging.is_progress_bar_enabled()
    hf_config.HF_HUB_OFFLINE = True
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_config.HF_HUB_OFFLINE = saved_flag
        if bars:
            hf_logging.enable_progress_bar()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def quiet_lm_eval() -> None:
    """lm_eval's INFO lines (one per task and request type) off: titan-npu prints its own summary."""
    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.WARNING)


def load_tasks(names: Sequence[str], include_paths: Sequence[str] = (), num_fewshot: int | None = None
               ) -> dict[str, Any]:
    """lm_eval's loaded tasks ({"tasks", "groups", "group_map"}) for `names`, each checked: a known name, its data on
    disk, a few-shot pool of at least num_fewshot examples. ConfigError / DataError name what is wrong."""
    from lm_eval.tasks import TaskManager

    quiet_lm_eval()
    for folder in include_paths:
        if not Path(folder).is_dir():
            raise ConfigError(f"--include-path {folder} is not a folder; give a folder of lm_eval task YAML files")
    shipped = shipped_tasks()
    # lm_eval's own index of ~15k tasks takes seconds to build: only when a name is neither shipped nor included.
    local = TaskManager(include_path=list(include_paths) or None, include_defaults=False) if include_paths else None
    known_locally = set(shipped) | set(local.all_tasks if local else [])
    manager = local
    if any(n not in known_locally for n in names):
        manager = TaskManager(include_path=list(include_paths) or None)
        unknown = [n for n in names if n not in shipped and n not in manager.all_tasks]
        if unknown:
            raise ConfigError(f"unknown task {unknown[0]!r}; the shipped tasks are {', '.join(sorted(shipped))}, "
                              f"lm_eval's own are listed by `lm_eval ls tasks`, and --include-path DIR adds the task "
                              f"YAMLs of a folder")
    if manager is None:
        manager = TaskManager(include_defaults=False)
    specs = [shipped[n] if n in shipped else n for n in names]
    with offline():
        try:
            loaded = manager.load(specs)
        except Exception as e:  # datasets' offline refusal is one of several classes (ConnectionError, ...)
            raise DataError(_not_on_disk(names, e)) from None
    for name, task in loaded["tasks"].items():
        _apply_fewshot(name, task, num_fewshot)
    return loaded


def _not_on_disk(names: Sequence[str], error: Exception) -> str:
    first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
    return (f"the data of task(s) {', '.join(names)} could not be read offline ({type(error).__name__}: {first}); "
            f"titan-npu eval never downloads: fetch it once with network (`python -c \"import datasets; "
            f"datasets.load_dataset('<dataset_path>')\"` fills the Hugging Face cache), or copy the task's YAML into "
            f"a folder with a local dataset_path / data_files and pass --include-path")


def _apply_fewshot(name: str, task: Any, num_fewshot: int | None) -> None:
    """num_fewshot on the task as lm_eval's simple_evaluate sets it, refused when the task's pool is smaller."""
    if num_fewshot is not None and task.get_config("num_fewshot") != 0:
        task.set_config(key="num_fewshot", value=num_fewshot)
    elif task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)
    task.set_fewshot_seed(seed=FEWSHOT_SEED)
    wanted = task.get_config("num_fewshot") or 0
    if wanted == 0:
        return
    docs = task.fewshot_docs()
    # Without a few-shot split lm_eval draws the examples from the evaluated docs themselves, minus the one asked.
    pool = len(docs) if docs is not None else len(task.eval_docs)
    if not (task.config.fewshot_split or task.has_training_docs() or task.has_validation_docs()):
        pool -= 1  # drawn from the evaluated docs themselves, less the one being asked
    if wanted > pool:
        raise ConfigError(f"--num-fewshot {wanted} is more than task {name}'s pool of {pool} few-shot examples; "
                          f"ask for at most {pool}")


def run_tasks(lm: Any, loaded: dict[str, Any], limit: int | None = None) -> dict[str, Any]:
    """lm_eval's evaluate() of `lm` on loaded tasks; its results dict on rank 0 (None on other ranks)."""
    from lm_eval.evaluator import evaluate

    with offline():
        return evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0, log_samples=False,
                        verbosity="WARNING")


def summarize(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from lm_eval's results ("acc,none" -> "acc"; stderr and aliases dropped)."""
    summary: dict[str, dict[str, float]] = {}
    for task, metrics in results.get("results", {}).items():
        row = {}
        for key, value in metrics.items():
            metric, _, _filter = key.partition(",")
            if metric.endswith("_stderr") or metric == "sample_len" or type(value) not in (int, float):
                continue
            row[metric] = float(value)
        summary[task] = row
    return summary
