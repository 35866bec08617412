"""One "host" of a run spread over two hosts SIGKILLed mid-extraction, then the run's retry: the per-host
child flow (`flows/host_phase.py`, the `host-phase` deployment's flow) run as a worker would run it, without
workers, against the session's Prefect API, with the transformers backend on the tiny Llama (one sample a
shard). Host 1 extracts its slice; host 0's child process is SIGKILLed by `EAGLE3_FAULT`
(`kill-process@samples=n`, no `finally`, no hook) after some of its shards were written. The retry starts
both children again, as the parent's task does, and merges their slices (`merge_slices`): host 1's slice
returns from its folder without a weight load, host 0's resumes at its first missing shard; no finished
shard of either slice is written again (inode, mtime and sha256 unchanged), only host 0's missing shards
are written, and the merged HiddenStateSet holds every training sample exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL

from eagle3_core.artifacts import HiddenStateSet, SampleSet, TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import CACHE_HIT, RESUME, WEIGHT_LOAD, RunEvents
from eagle3_core.extraction.merge import merge_slices
from eagle3_core.extraction.phase import DONE_SUFFIX, training_rows
from eagle3_core.faults import ENV
from eagle3_core.files import sha256_file
from eagle3_core.hidden_states.reader import INDEX_FILE, HiddenStateDataset
from eagle3_core.hidden_states.storage import shard_name
from eagle3_core.hosts import HostSlice, every_slice
from eagle3_core.run_layout import RunLayout
from flows.host_phase import host_phase
from tasks.hosts import on_host
from tests.helpers.extraction_fixtures import build_sample_set
from tests.helpers.served_targets import pinned_dtypes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SAMPLES = 12  # p0000..p0011: 7 for host 0, 5 for host 1
KILLED = HostSlice(0, 2)
CHILD = """
import sys
from eagle3_core.artifacts import SampleSet, TargetModel
from eagle3_core.config import PipelineConfig
from flows.host_phase import host_phase
config, sample_set, target = (open(path).read() for path in sys.argv[1:4])
host_phase(PipelineConfig.model_validate_json(config), "extraction", TargetModel.model_validate_json(target),
           sample_set=SampleSet.model_validate_json(sample_set))
"""


def config_for(run_dir: Path) -> PipelineConfig:
    return PipelineConfig.model_validate(
        pinned_dtypes(
            {
                "run_dir": str(run_dir),
                "sampling": {"holdout_fraction": 0.0},
                "extraction": {
                    "backend": "hf",
                    "compute_dtype": "float32",
                    "batch_size": 1,
                    "samples_per_shard": 1,
                    "writer_threads": 1,
                },
                "orchestration": {"hosts": 2, "retries": 0},
            }
        )
    )


def child_process(config: PipelineConfig, sample_set: SampleSet, target: TargetModel, fault: str, log: Path) -> int:
    """Run host `config.orchestration.host`'s child flow in a process of its own, as a worker does; its exit."""
    files = []
    for name, model in (("config", config), ("sample_set", sample_set), ("target", target)):
        files.append(log.with_name(f"{log.stem}-{name}.json"))
        files[-1].write_text(model.model_dump_json())
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(REPO), ENV: fault}
    with open(log, "w") as out:
        child = subprocess.run(
            [sys.executable, "-c", CHILD, *map(str, files)], cwd=REPO, env=env, stdout=out, stderr=out
        )
    return child.returncode


def shard_files(folder: Path) -> dict[str, tuple[int, int, str]]:
    """Every shard and completion record of a slice's folder: name -> (inode, mtime in ns, sha256)."""
    found = {}
    for path in sorted(folder.glob("shard-*")):
        stat = path.stat()
        found[path.name] = (stat.st_ino, stat.st_mtime_ns, sha256_file(path))
    return found


def done_shards(folder: Path) -> set[str]:
    return {path.name.removesuffix(DONE_SUFFIX) for path in folder.glob(f"shard-*{DONE_SUFFIX}")}


@pytest.mark.timeout(600)
def test_a_host_killed_mid_extraction_redoes_only_its_missing_shards(
    prefect_api, smollm2_target: TargetModel, tiny_llama: TargetModel, tmp_path: Path
):
    config = config_for(tmp_path / "run")
    sample_set = build_sample_set(tmp_path / "samples", smollm2_target.root_path, num_ok=SAMPLES)
    folders = {part.host: RunLayout.of(on_host(config, part.host)).hidden_states for part in every_slice(2)}
    wanted = {row["id"] for row in training_rows(sample_set, 0.0)}
    killed_ids = {sample_id for sample_id in wanted if KILLED.takes(sample_id)}
    assert (len(wanted), len(killed_ids)) == (SAMPLES, 7)

    host_phase(on_host(config, 1), "extraction", tiny_llama, sample_set=sample_set)
    fault = f"extraction:kill-process@samples={len(killed_ids) - 1}"  # before its last shard is submitted
    returncode = child_process(on_host(config, 0), sample_set, tiny_llama, fault, tmp_path / "host-0.log")
    assert returncode == -signal.SIGKILL, (tmp_path / "host-0.log").read_text()[-3000:]
    kept = done_shards(folders[0])
    assert 1 <= len(kept) < len(killed_ids), "killed after some of its shards were written, before the last"
    assert HiddenStateSet.load_valid(folders[0]) is None
    before = {host: shard_files(folder) for host, folder in folders.items()}
    finished = {host: {name: before[host][name] for name in done_shards(folder)} for host, folder in folders.items()}

    retried = RunEvents(config.run_dir).path.stat().st_size
    for part in every_slice(2):  # the parent's retry starts every child again
        host_phase(on_host(config, part.host), "extraction", tiny_llama, sample_set=sample_set)
    merged = merge_slices(config, sample_set, tiny_llama, RunEvents(config.run_dir))

    after = {host: shard_files(folder) for host, folder in folders.items()}
    for host, shards in finished.items():
        assert {name: after[host][name] for name in shards} == shards, f"host {host} rewrote a finished shard"
    assert after[1] == before[1], "the finished slice writes nothing"
    written = {name.removesuffix(DONE_SUFFIX) for name in after[0] if name.endswith(DONE_SUFFIX)} - kept
    assert written == {shard_name(i) for i in range(len(killed_ids))} - kept
    assert done_shards(folders[0]) == kept | written and len(kept | written) == len(killed_ids)

    with open(RunEvents(config.run_dir).path) as log:
        log.seek(retried)
        events = [json.loads(line) for line in log]
    [resume] = [e for e in events if e["event"] == RESUME]
    assert set(resume["pending"]) == written
    assert [e["event"] for e in events if e["event"] in (CACHE_HIT, WEIGHT_LOAD)] == [WEIGHT_LOAD, CACHE_HIT]

    index = json.loads(merged.path_of(INDEX_FILE).read_text())["samples"]
    assert Counter(entry["id"] for entry in index) == Counter(wanted)
    assert merged.samples == SAMPLES and sorted(HiddenStateDataset(merged, 4096).sample_ids) == sorted(wanted)
    assert {entry["shard"].split("/")[0] for entry in index if entry["id"] in killed_ids} == {KILLED.name}
