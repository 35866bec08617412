"""The run directory's folder names are written once, in eagle3_core/run_layout.py: the phases, the CLI
and the flows take their paths from `RunLayout`."""

from __future__ import annotations

import re
from pathlib import Path

from eagle3_core.config import PipelineConfig, ServerConfig
from eagle3_core.events import RunEvents
from eagle3_core.run_layout import RunLayout
from eagle3_core.serving.engine import VllmServer

REPO = Path(__file__).resolve().parents[3]
FOLDERS = ("samples", "hidden_states", "incoming", "vocab", "draft", "export", "state", "eval", "summary", "server")
# A folder name joined onto a path: `/ "samples"`, `/ 'draft'`.
JOINED = re.compile(r"/\s*[\"'](" + "|".join(FOLDERS) + r")[\"']")


def test_no_folder_of_the_run_directory_is_named_outside_the_layout():
    sources = [p for d in ("eagle3_core", "tasks", "flows", "cli") for p in (REPO / d).rglob("*.py")]
    named = [f"{p.relative_to(REPO)}: {m.group(0)}" for p in sources if p.name != "run_layout.py"
             for m in JOINED.finditer(p.read_text())]  # fmt: skip
    assert not named, f"folder names typed outside eagle3_core/run_layout.py: {named}"


def test_the_engine_writes_the_pid_file_the_flow_hooks_find(tmp_path: Path):
    layout = RunLayout.of(PipelineConfig(run_dir=tmp_path))
    server = VllmServer(ServerConfig(), tmp_path / "model", tmp_path, RunEvents(tmp_path), phase="sampling")
    server.pid_file.parent.mkdir(parents=True)
    server.pid_file.write_text("{}")
    assert layout.pid_files() == [layout.pid_file("sampling")] == [server.pid_file]


def test_the_promoted_drafter_keeps_the_draft_layout(tmp_path: Path):
    layout = RunLayout(tmp_path)
    assert layout.current.draft.export == tmp_path / "current" / "draft" / "export"
    assert layout.current.version("1").draft.export == tmp_path / "current.d" / "1" / "draft" / "export"
    assert layout.draft.state.parent == layout.draft.export.parent == layout.draft.root
