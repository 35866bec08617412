"""A disk that fills in the middle of a phase: the phase fails with a `DiskFullError` naming the file and the
bytes, leaves no partial Parquet part, shard or checkpoint behind, and once space is freed the re-run resumes
where it stopped (sampling keeps its rows, extraction its finished shards).

The disk is a real small tmpfs mounted over part of the run directory; it is filled mid-phase by a ballast
file, as another user's job would on a shared host, and freed by deleting the ballast."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from eagle3_core.artifacts import HiddenStateSet
from eagle3_core.config import PipelineConfig
from eagle3_core.events import PREFLIGHT, RESUME, WEIGHT_LOAD, RunEvents
from eagle3_core.extraction.phase import extract_hidden_states
from eagle3_core.files import DiskFullError, free_bytes
from eagle3_core.preflight import PreflightError
from eagle3_core.progress import ProgressUpdate
from eagle3_core.sampling.phase import sample_prompts
from eagle3_core.sampling.table import iter_rows, read_part, write_part
from eagle3_core.training.state import LATEST, latest_state, save_state
from tests.helpers.extraction_fixtures import build_sample_set
from tests.helpers.served_targets import FLOAT32, pinned_dtypes

BALLAST = "ballast.bin"


@contextmanager
def small_disk(path: Path, size_kib: int) -> Iterator[Path]:
    """A tmpfs of `size_kib` KiB mounted at `path`; unmounted on exit whatever happens."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        # A tmpfs can read "target is busy" for a moment after its last file is closed, with no process
        # holding it (fuser names none: pyarrow's I/O threads release their files late), in about 1 unmount
        # of 10 on a loaded machine. A lazy unmount detaches it at once and frees it when the kernel is done.
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill(disk: Path, leave: int = 0) -> None:
    """Take all but `leave` bytes of the disk's free space with a ballast file."""
    size = free_bytes(disk) - leave
    with open(disk / BALLAST, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, size)


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".tmp-" in p.name]


def test_a_full_disk_while_writing_a_parquet_part_keeps_the_earlier_parts(tmp_path):
    with small_disk(tmp_path / "samples", 512) as disk:
        rows = [{"id": f"p{i}", "status": "ok", "messages": [], "response": "x" * 2000} for i in range(4)]
        write_part(rows[:2], disk / "part-00000.parquet")
        fill(disk)
        with pytest.raises(DiskFullError) as error:
            write_part(rows[2:], disk / "part-00001.parquet")
        assert f"{disk / 'part-00001.parquet'}" in str(error.value) and "bytes are free" in str(error.value)
        assert error.value.needed > 0
        assert sorted(p.name for p in disk.iterdir()) == [BALLAST, "part-00000.parquet"]
        assert [r["id"] for r in read_part(disk / "part-00000.parquet")] == ["p0", "p1"]


def test_a_full_disk_while_saving_a_training_checkpoint_keeps_the_previous_one(tmp_path):
    with small_disk(tmp_path / "state", 2048) as disk:
        weights = {"w": torch.randn(64, 64)}
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)])
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        save_state(disk, 1, weights, {}, scheduler, {"epoch": 0}, [], keep=2)
        fill(disk, leave=4096)
        with pytest.raises(DiskFullError) as error:
            save_state(disk, 2, {"w": torch.randn(256, 256)}, {}, scheduler, {"epoch": 0}, [], keep=2)
        assert "step-00000002.pt" in str(error.value) and f"{error.value.needed:,} bytes" in str(error.value)
        assert error.value.needed >= 256 * 256 * 4
        assert leftovers(disk) == []
        assert latest_state(disk) == disk / "step-00000001.pt"
        assert json.loads((disk / LATEST).read_text())["step"] == 1


def test_extraction_on_a_disk_too_small_fails_in_preflight_without_loading_weights(tmp_path, smollm2_target):
    sample_set = build_sample_set(tmp_path / "samples", smollm2_target.root_path, num_ok=4)
    run_dir = tmp_path / "run"
    config = PipelineConfig(run_dir=run_dir, extraction={"backend": "hf", "device": "cpu"})
    events = RunEvents(run_dir)
    with small_disk(run_dir / "hidden_states", 256) as disk:
        with pytest.raises(PreflightError) as error:
            extract_hidden_states(config, sample_set, smollm2_target, events)
        assert f"{disk}: needs about" in str(error.value) and "bytes are free" in str(error.value)
        assert list(disk.iterdir()) == []
    [line] = [e for e in events.read() if e["event"] == PREFLIGHT]
    assert line["ok"] is False and line["disk_needed"] > line["disk_free"]
    assert events.count(WEIGHT_LOAD) == 0


@pytest.mark.slow
def test_extraction_fills_the_disk_then_resumes_from_its_finished_shards(tmp_path, smollm2_target):
    sample_set = build_sample_set(tmp_path / "samples", smollm2_target.root_path, num_ok=8)
    run_dir = tmp_path / "run"
    config = PipelineConfig.model_validate(
        pinned_dtypes(
            {
                "run_dir": run_dir,
                "sampling": {"holdout_fraction": 0.0},
                "extraction": {"backend": "hf", "samples_per_shard": 2, "writer_threads": 1, "device": "cpu"},
            }
        )
    )
    events = RunEvents(run_dir)
    with small_disk(run_dir / "hidden_states", 16 * 1024) as disk:
        first_done = disk / "shard-00000.safetensors.done.json"

        def fill_after_first_shard(update: ProgressUpdate) -> None:
            """Another job takes the disk once the first shard is safely written."""
            if update.stage != "samples" or (disk / BALLAST).exists():
                return
            deadline = time.monotonic() + 60
            while not first_done.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            fill(disk, leave=16 * 1024)

        with pytest.raises(DiskFullError) as error:
            extract_hidden_states(config, sample_set, smollm2_target, events, progress=fill_after_first_shard)
        message = str(error.value)
        assert "disk full writing" in message and "shard-0000" in message and "bytes are free" in message
        assert leftovers(disk) == []
        kept = sorted(p.name for p in disk.glob("shard-*.safetensors"))
        assert kept[0] == "shard-00000.safetensors"
        assert all((disk / (name + ".done.json")).exists() for name in kept), "a shard without its record"
        first_bytes = (disk / "shard-00000.safetensors").read_bytes()

        (disk / BALLAST).unlink()
        hidden = extract_hidden_states(config, sample_set, smollm2_target, events)
        assert hidden.samples == 8 and HiddenStateSet.load(disk).digest == hidden.digest
        hidden.validate(deep=True)
        assert (disk / "shard-00000.safetensors").read_bytes() == first_bytes
        resume = [e for e in events.read() if e["event"] == RESUME]
        assert len(resume) == 1 and f"{len(kept)} of 4 shards done" in resume[0]["message"]
        assert events.count(WEIGHT_LOAD) == 2


@pytest.mark.slow
def test_sampling_fills_the_disk_then_resumes_keeping_its_rows(tmp_path, smollm2_target, served):
    run_dir = tmp_path / "run"
    config = PipelineConfig(
        run_dir=run_dir,
        server=FLOAT32,
        sampling={"max_prompts": 8, "max_tokens": 16, "concurrency": 1, "rows_per_part": 2},
    )
    events = RunEvents(run_dir)
    server = served.get(smollm2_target, config.server)
    with small_disk(run_dir / "samples", 1024) as disk:

        def fill_after_first_part(update: ProgressUpdate) -> None:
            """Another job takes the disk once the first part (two rows) is written."""
            if update.done >= 2 and not (disk / BALLAST).exists():
                fill(disk)

        with pytest.raises(DiskFullError) as error:
            sample_prompts(config, smollm2_target, events, progress=fill_after_first_part, server=server)
        assert f"{disk / 'part-00001.parquet'}" in str(error.value) and "bytes are free" in str(error.value)
        assert leftovers(disk) == []
        assert sorted(p.name for p in disk.glob("part-*")) == ["part-00000.parquet"]
        written = read_part(disk / "part-00000.parquet")
        assert [r["status"] for r in written] == ["ok", "ok"]

        (disk / BALLAST).unlink()
        sample_set = sample_prompts(config, smollm2_target, events, server=server)
        assert (sample_set.prompts, sample_set.ok, sample_set.error) == (8, 8, 0)
        rows = {r["id"]: r for r in iter_rows(sample_set)}
        assert all(rows[r["id"]]["response"] == r["response"] for r in written)
        [resume] = [e for e in events.read() if e["event"] == RESUME]
        assert resume["kept"] == 2
