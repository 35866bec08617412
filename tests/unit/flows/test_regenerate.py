"""The nightly flow's promotion rules, on real files (no Prefect run, no engine): the better drafter
becomes `current` (a symlink to a complete copy), and the next run warm-starts from its export; a crash
between any two steps of a promotion leaves a `current`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eagle3_core.artifacts import DraftCheckpoint, EvalReport, FileRecord
from eagle3_core.config import PipelineConfig
from eagle3_core.run_layout import RunLayout
from flows.regenerate import is_better, load_current, promote, warm_start_config


def fake_checkpoint(run_dir: Path, weights: bytes) -> DraftCheckpoint:
    root = run_dir / "draft"
    (root / "export").mkdir(parents=True, exist_ok=True)
    (root / "state").mkdir(exist_ok=True)
    (root / "export" / "model.safetensors").write_bytes(weights)
    (root / "state" / "optimizer.pt").write_bytes(b"large and only for resuming")
    checkpoint = DraftCheckpoint(root=str(root), files=[FileRecord.of(root / "export" / "model.safetensors", root)])
    checkpoint.save()
    return checkpoint


def report(run_dir: Path, tau: float) -> EvalReport:
    return EvalReport(root=str(run_dir / "eval"), acceptance_length=tau, per_position=[tau - 1])


def test_promotion_keeps_the_better_drafter_and_warm_starts_from_it(tmp_path: Path):
    config = PipelineConfig(run_dir=tmp_path / "run")
    assert warm_start_config(config) is config
    first = fake_checkpoint(config.run_dir, b"first")
    assert is_better(report(config.run_dir, 1.4), None)
    promote(config, first, report(config.run_dir, 1.4))
    current = load_current(config)
    assert current is not None and current.acceptance_length == 1.4
    assert current.checkpoint_digest == first.digest
    assert (RunLayout.of(config).current.draft.export / "model.safetensors").read_bytes() == b"first"
    assert not (RunLayout.of(config).current.draft.state).exists()
    assert DraftCheckpoint.load(RunLayout.of(config).current.draft.root).digest == first.digest

    warm = warm_start_config(config)
    assert warm.training.warm_start == str(RunLayout.of(config).current.draft.export)
    assert config.training.warm_start is None

    assert not is_better(report(config.run_dir, 1.3), current)
    second = fake_checkpoint(config.run_dir, b"second")
    assert is_better(report(config.run_dir, 1.6), current)
    promote(config, second, report(config.run_dir, 1.6))
    assert load_current(config).acceptance_length == 1.6
    assert (RunLayout.of(config).current.draft.export / "model.safetensors").read_bytes() == b"second"
    assert sorted(p.name for p in config.run_dir.iterdir()) == ["current", "current.d", "draft"]
    assert len(list((config.run_dir / "current.d").iterdir())) == 2, "the new copy and the one it replaced"


def promoted_weights(config: PipelineConfig) -> bytes:
    return (RunLayout.of(config).current.draft.export / "model.safetensors").read_bytes()


def killed_at(step: str, real=os.replace):
    """A stand-in for `shutil.copytree` or `os.replace` that kills the promotion at `step`: the copy of the
    export, or the swap of `current` (the rename of its `.link`); other renames go through."""

    def stand_in(*args, **kwargs):
        if step == "copy" or str(args[0]).endswith(".link"):
            raise KeyboardInterrupt  # as a kill would stop the promotion there
        return real(*args, **kwargs)

    return stand_in


@pytest.mark.parametrize(("step", "target"), [("copy", "shutil.copytree"), ("swap", "os.replace")])
def test_a_promotion_killed_at_any_step_leaves_the_old_current(tmp_path: Path, monkeypatch, step, target):
    config = PipelineConfig(run_dir=tmp_path / "run")
    promote(config, fake_checkpoint(config.run_dir, b"first"), report(config.run_dir, 1.4))
    monkeypatch.setattr(target, killed_at(step))
    with pytest.raises(KeyboardInterrupt):
        promote(config, fake_checkpoint(config.run_dir, b"second"), report(config.run_dir, 1.6))
    monkeypatch.undo()
    assert promoted_weights(config) == b"first" and load_current(config).acceptance_length == 1.4
    promote(config, fake_checkpoint(config.run_dir, b"second"), report(config.run_dir, 1.6))
    assert promoted_weights(config) == b"second"


def test_a_current_lost_between_two_renames_of_an_earlier_version_is_restored(tmp_path: Path):
    """Earlier versions renamed `current` to `current.old`, then `current.new` to `current`: a kill between
    the two left no `current`. It is found back, and the next promotion replaces it."""
    config = PipelineConfig(run_dir=tmp_path / "run")
    promote(config, fake_checkpoint(config.run_dir, b"first"), report(config.run_dir, 1.4))
    current = RunLayout.of(config).current.root
    copy = current.resolve()
    current.unlink()
    copy.rename(config.run_dir / "current.old")
    assert load_current(config).acceptance_length == 1.4 and promoted_weights(config) == b"first"
    promote(config, fake_checkpoint(config.run_dir, b"second"), report(config.run_dir, 1.6))
    assert promoted_weights(config) == b"second" and current.is_symlink()


def test_a_copied_current_folder_of_an_earlier_version_becomes_a_symlink_once_the_new_copy_is_complete(
    tmp_path: Path,
):
    config = PipelineConfig(run_dir=tmp_path / "run")
    promote(config, fake_checkpoint(config.run_dir, b"first"), report(config.run_dir, 1.4))
    current = RunLayout.of(config).current.root
    copy = current.resolve()
    current.unlink()
    copy.rename(current)  # a copied folder, as earlier versions left it
    promote(config, fake_checkpoint(config.run_dir, b"second"), report(config.run_dir, 1.6))
    assert current.is_symlink() and promoted_weights(config) == b"second"
