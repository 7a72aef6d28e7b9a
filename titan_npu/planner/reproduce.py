"""Published training runs planned as the planner would plan them: the estimate beside the measured figure.

A published run is a titan-npu config file (model, training, parallel, activation_checkpoint, compile sections: the
run's layout) with one more section, [published]: where the figure comes from (citation), the cluster (device,
nodes, devices_per_node) and the tokens per second per device the source reports. benchmarks/published/ holds them;
`titan-npu plan --reproduce FILE` prints one, planner/calibration.py fits the device efficiencies on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from titan_npu.config.loader import config_from_dict, read_config_file
from titan_npu.config.schema import JobConfig
from titan_npu.errors import ConfigError
from titan_npu.planner.hardware import Hardware, hardware
from titan_npu.planner.layout import GiB, job_from_config, layout_from_config
from titan_npu.planner.search import Candidate, check_layout, evaluate, usable_fraction

PUBLISHED_KEYS = ("source", "citation", "device", "hardware", "nodes", "devices_per_node", "precision",
                  "tokens_per_s_per_device", "notes")


@dataclass(frozen=True)
class PublishedRun:
    """One published training run: its citation, cluster and reported speed, and the config of its layout."""

    id: str  # the file's stem
    source: str
    citation: str
    device: str  # a planner device name (planner/hardware.py)
    hardware: str  # the source's own words for the machines
    nodes: int
    devices_per_node: int
    precision: str
    tokens_per_s_per_device: float
    notes: str
    config: JobConfig

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


def load_published(path: str | Path) -> PublishedRun:
    """Read a published run's file: its [published] section and the config the rest of the file is."""
    data = read_config_file(path)
    published = data.pop("published", None)
    if not isinstance(published, dict):
        raise ConfigError(f"{path}: no [published] section; a published run needs one with "
                          f"{', '.join(PUBLISHED_KEYS)}")
    missing = [k for k in PUBLISHED_KEYS if k not in published]
    unknown = sorted(set(published) - set(PUBLISHED_KEYS))
    if missing or unknown:
        problem = f"lacks {', '.join(missing)}" if missing else f"has unknown keys {', '.join(unknown)}"
        raise ConfigError(f"{path}: [published] {problem} (keys: {', '.join(PUBLISHED_KEYS)})")
    if published["tokens_per_s_per_device"] <= 0:
        raise ConfigError(f"{path}: published.tokens_per_s_per_device must be > 0")
    fields = {k: published[k] for k in PUBLISHED_KEYS}
    return PublishedRun(id=Path(path).stem, config=config_from_dict(data, str(path)), **fields)


# Where the published runs of a source checkout are; `--reproduce NAME` also looks in ./benchmarks/published.
PUBLISHED_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "published"


def published_path(run: str) -> Path:
    """The file of `plan --reproduce RUN`: RUN itself when it exists, else the published run of that name (as the
    table in docs/planning.md and `published run NAME` print it) in PUBLISHED_DIR or ./benchmarks/published."""
    path = Path(run)
    if path.exists():
        return path
    folders = [d for d in dict.fromkeys((PUBLISHED_DIR, Path.cwd() / "benchmarks" / "published")) if d.is_dir()]
    name = path.name.strip("`").removesuffix(".toml").lower().replace("-", "_")
    for folder in folders:
        if (folder / f"{name}.toml").is_file():
            return folder / f"{name}.toml"
    if not folders:
        raise ConfigError(f"--reproduce {run}: no such file, and no benchmarks/published folder here to find a run "
                          f"of that name in; give the path of a published run's .toml")
    names = sorted({p.stem for folder in folders for p in folder.glob("*.toml")})
    raise ConfigError(f"--reproduce {run}: no such file, nor a published run of that name in {folders[0]}; give a "
                      f"file or one of: {', '.join(names) or '(none there)'}")


def published_runs(directory: str | Path) -> list[PublishedRun]:
    """Every published run in `directory` (*.toml), in file-name order."""
    paths = sorted(Path(directory).glob("*.toml"))
    if not paths:
        raise ConfigError(f"{directory}: no published runs (*.toml) there")
    return [load_published(p) for p in paths]


@dataclass(frozen=True)
class Reproduction:
    """A published run, the planner's evaluation of its layout, and estimate / published."""

    run: PublishedRun
    hw: Hardware
    efficiency: float
    candidate: Candidate

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.candidate.step.tokens_per_s / self.run.world_size

    @property
    def ratio(self) -> float:
        """Estimate / published."""
        return self.tokens_per_s_per_device / self.run.tokens_per_s_per_device

    def as_dict(self) -> dict:
        r = self.run
        return {"id": r.id, "source": r.source, "citation": r.citation, "device": r.device, "nodes": r.nodes,
                "devices_per_node": r.devices_per_node, "precision": r.precision, "notes": r.notes,
                "published_tokens_per_s_per_device": r.tokens_per_s_per_device,
                "estimate_tokens_per_s_per_device": self.tokens_per_s_per_device, "ratio": self.ratio,
                "efficiency": self.efficiency, "layout": self.candidate.layout.describe(),
                "estimate": self.candidate.step.as_dict(), "memory_gib": self.candidate.memory.total / GiB}


def reproduce(run: PublishedRun, efficiency: float | None = None) -> Reproduction:
    """Plan the published run's own layout (no search) and estimate its speed; efficiency None = calibrated."""
    from titan_npu.planner.efficiency import calibrated_efficiency

    cfg, world = run.config, run.world_size
    hw = hardware(run.device)
    eff = calibrated_efficiency(hw.device_type) if efficiency is None else efficiency
    job = job_from_config(cfg)
    layout = layout_from_config(cfg, world)
    check_layout(cfg, job, layout.degrees)
    candidate = evaluate(job, layout, hw, run.devices_per_node, eff, cfg.comm.hccl_buffsize_mb, usable_fraction(cfg))
    return Reproduction(run, hw, eff, candidate)


def format_reproduction(rep: Reproduction, error_band: float) -> str:
    """A reproduction as text: the run, its citation, the planned layout, the estimate and estimate / published."""
    r, s = rep.run, rep.candidate.step
    return "\n".join([
        f"published run {r.id} ({r.source}): {r.nodes} node(s) x {r.devices_per_node} {r.device}, {r.precision}",
        f"  source: {r.citation}",
        f"  hardware: {r.hardware}",
        f"  notes: {r.notes}",
        f"layout: {rep.candidate.layout.describe()}",
        f"estimate: {rep.tokens_per_s_per_device:,.1f} tokens/s per device (±{100 * error_band:.0f}%), MFU "
        f"{100 * s.mfu:.1f}%, step {s.step_time:.2f}s (compute {s.compute:.2f}s at {100 * rep.efficiency:.1f}% of "
        f"peak, tp {s.tp_comm:.2f}s, pp {s.pp_comm + s.bubble:.2f}s, exposed fsdp {s.fsdp_exposed:.2f}s)",
        f"published: {r.tokens_per_s_per_device:,.1f} tokens/s per device",
        f"estimate / published: {rep.ratio:.3f}",
    ])
