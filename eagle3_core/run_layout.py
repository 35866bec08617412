"""The run directory's layout: the one place every folder name under `run_dir` is written. The phases, the
CLI and the flows all take their paths from here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3_core.config import PipelineConfig
from eagle3_core.hosts import HostSlice, host_slice, slice_named

EXPORT = "export"
STATE = "state"


@dataclass(frozen=True)
class DraftLayout:
    """A draft folder: the training run's (`<run_dir>/draft`) or a copy of it (`<run_dir>/current/draft`)."""

    root: Path

    @property
    def export(self) -> Path:
        """The vLLM/SGLang-loadable folder (config.json + model.safetensors)."""
        return self.root / EXPORT

    @property
    def state(self) -> Path:
        """Resumable training states (only in the training run's folder)."""
        return self.root / STATE

    @property
    def launch(self) -> Path:
        """A torchrun launch of training (`training.processes` > 1): its config, rank 0's progress, rank logs."""
        return self.root / "launch"


@dataclass(frozen=True)
class PromotedLayout:
    """The nightly flow's promoted drafter, `<run_dir>/current` (a symlink to one of its `versions`), or one
    of those copies: the draft folder (without training states) and `current.json`, which says why it is
    current."""

    root: Path

    @property
    def draft(self) -> DraftLayout:
        return DraftLayout(self.root / "draft")

    @property
    def record(self) -> Path:
        return self.root / "current.json"

    @property
    def versions(self) -> Path:
        """`current.d/`: the promoted copies, each complete before `current` (a symlink) is pointed at it."""
        return self.root.with_name(self.root.name + ".d")

    def version(self, name: str) -> PromotedLayout:
        """One promoted copy under `versions`."""
        return PromotedLayout(self.versions / name)


@dataclass(frozen=True)
class RunLayout:
    """The folders of a run; with `part`, a host's slice of a run spread over hosts, whose samples and
    hidden states are folders of their own under the run's (`eagle3_core.hosts`)."""

    root: Path
    part: HostSlice | None = None

    @classmethod
    def of(cls, config: PipelineConfig) -> RunLayout:
        return cls(Path(config.run_dir), host_slice(config))

    def sliced(self, folder: Path) -> Path:
        return folder if self.part is None else self.part.folder(folder)

    @property
    def samples(self) -> Path:
        return self.sliced(self.root / "samples")

    @property
    def hidden_states(self) -> Path:
        return self.sliced(self.root / "hidden_states")

    @property
    def incoming_states(self) -> Path:
        """Where vLLM's connector drops states before extraction validates and shards them."""
        return self.hidden_states / "incoming"

    @property
    def vocab(self) -> Path:
        return self.root / "vocab"

    @property
    def draft(self) -> DraftLayout:
        return DraftLayout(self.root / "draft")

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def summary(self) -> Path:
        """The flow's run summary (`summary.md`, the acceptance plot)."""
        return self.root / "summary"

    @property
    def summary_markdown(self) -> Path:
        return self.summary / "summary.md"

    @property
    def current(self) -> PromotedLayout:
        return PromotedLayout(self.root / "current")

    @property
    def server(self) -> Path:
        """Engine pid files and logs, one of each per phase (and per host's slice)."""
        return self.root / "server"

    def engine_file(self, phase: str, suffix: str) -> Path:
        """`<phase><suffix>` in `server/` (`.pid`, `.log`, `.previous.log`); a host's slice has its own,
        `<phase>-host-<i>-of-<N><suffix>`, as the hosts share the folder."""
        return self.server / (f"{phase}{suffix}" if self.part is None else f"{phase}-{self.part.name}{suffix}")

    def pid_file(self, phase: str) -> Path:
        return self.engine_file(phase, ".pid")

    def pid_files(self) -> list[Path]:
        """The pid files of this layout's engines and training agent (`training.pid`): a slice's own, or
        without a slice those of no slice. Never another slice's: its engine may run on another host, or
        beside this one (two workers on one host), and is that slice's to stop."""
        return sorted(p for p in self.server.glob("*.pid") if slice_named(p.stem) == self.part)

    @property
    def kept_results(self) -> Path:
        """The results of other settings, kept (`eagle3_core.kept`): never deleted by the pipeline."""
        return self.root / "kept"

    def kept(self, folder: Path) -> Path:
        """Where results of other settings are kept for `folder` (a folder under the run's root):
        `<run_dir>/kept/<folder's path under the root>/`, one sub-folder per key (`eagle3_core.kept`)."""
        return self.kept_results / Path(folder).relative_to(self.root)

    @property
    def prefect_results(self) -> Path:
        """Prefect's persisted task results, unless `orchestration.result_storage` names another folder."""
        return self.root / ".prefect" / "results"
