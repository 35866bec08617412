"""The layers of pyproject.toml's import contracts (`lint-imports`, run by `make lint`): they hold on this
checkout, and each contract fails on a copy that breaks it, so a contract cannot pass by matching nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PACKAGES = ["eagle3_core", "cli", "tasks", "flows", "deployments"]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"]
    return subprocess.run([*command, "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300)


def test_the_contracts_hold() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("eagle3_core/events.py", "import prefect", "eagle3_core reaches no orchestration"),
        ("eagle3_core/vocab.py", "from tasks import policy", "eagle3_core reaches no orchestration"),
        ("eagle3_core/draft/model.py", "from eagle3_core.training import loss", "the draft knows nothing"),
        ("eagle3_core/draft/export.py", "from eagle3_core.training import unroll", "the draft knows nothing"),
        ("eagle3_core/draft/model.py", "from eagle3_core.draft import export", "the draft model knows nothing"),
        ("eagle3_core/serving/engine.py", "from eagle3_core.sampling import store", "serving (the engines)"),
        ("eagle3_core/training/batches.py", "from eagle3_core.extraction import phase", "training reads hidden states"),
        ("eagle3_core/hidden_states/reader.py", "from eagle3_core.training import loop", "the hidden states are data"),
        ("eagle3_core/preflight.py", "from eagle3_core.draft import shape", "the shared preflight knows no phase"),
        ("eagle3_core/sampling/table.py", "from eagle3_core.sampling import phase", "no import loops"),
        ("tasks/gpu_slot/records.py", "from prefect.settings import get_current_settings", "holder records are pure"),
        ("tasks/gpu_slot/records.py", "from tasks.gpu_slot import leases", "no import loops"),
        ("eagle3_core/planning/plan.py", "import huggingface_hub", "what the target is is decided"),
        ("cli/main.py", "from huggingface_hub import snapshot_download", "what the target is is decided"),
        ("eagle3_core/sampling/phase.py", "from datasets import load_dataset", "what the target is is decided"),
        ("eagle3_core/doctor.py", "from eagle3_core.server_defaults import resolve_server", "every auto is resolved"),
        ("flows/train_drafter.py", "from eagle3_core import server_defaults", "every auto is resolved"),
        ("eagle3_core/planning/estimate.py", "from eagle3_core.training import loop", "the planner reads and counts"),
        ("eagle3_core/planning/plan.py", "from eagle3_core.serving import engine", "the planner reads and counts"),
        ("eagle3_core/doctor.py", "from eagle3_core.planning import plan", "the doctor reads facts"),
        ("eagle3_core/release/card.py", "from eagle3_core.training import loop", "release publishes"),
    ],
)
def test_a_violation_fails(tmp_path: Path, module: str, line: str, broken: str) -> None:
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    with (tmp_path / module).open("a") as file:
        file.write(f"\n{line}\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert broken in result.stdout.split("Broken contracts")[-1]


def test_the_torch_only_modules_import_without_pydantic() -> None:
    """The GPU benchmark host has torch but no pydantic: the phase packages' `__init__` import nothing, so
    the draft model, the attention, the loss and the shard storage import there."""
    modules = ["eagle3_core.draft.model", "eagle3_core.training.attention", "eagle3_core.training.loss"]
    modules += ["eagle3_core.hidden_states.storage", "eagle3_core.extraction.hf_backend"]
    code = "import sys; sys.modules['pydantic'] = None; " + "; ".join(f"import {m}" for m in modules)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
