"""`training.processes: 2` on the CPU: the training task of a real Prefect flow run launches torchrun with two
gloo ranks of `eagle3 train` (tiny random Llama, tiny hf-extracted states), and

- both ranks train one draft: world 2, a log folder per rank, rank 0's progress relayed to the task;
- the draft is the one `torchrun --nproc-per-node 2 eagle3 train` trains by hand on the same data (same
  loss, same weights), and so is the one two nodes of one process each train (`--nnodes 2`, c10d rendezvous);
- a rank that fails fails the training with its error, traceback and log tail, and leaves nothing running;
- SIGKILL of the flow process mid-training leaves no rank or agent alive, and the next run resumes at the
  last checkpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
from prefect.settings import PREFECT_API_URL
from safetensors.torch import load_file
from training_flow import train_only

from eagle3_core.artifacts import DraftCheckpoint, HiddenStateSet, TargetModel, VocabMap
from eagle3_core.config import PipelineConfig
from eagle3_core.events import RESUME, RunEvents
from eagle3_core.extraction.phase import extract_hidden_states
from eagle3_core.run_layout import EXPORT, RunLayout
from eagle3_core.serving.engine import free_port
from eagle3_core.target.prepare import prepare_target
from eagle3_core.training.launch import LOGS_DIR, train_draft_on_host
from eagle3_core.training.rank_failure import RankFailed
from eagle3_core.vocab import build_vocab_map
from tasks.hosts import on_host
from tasks.policy import is_deterministic
from tests.helpers.extraction_fixtures import build_sample_set
from tests.helpers.served_targets import pinned_dtypes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
FLOW_SCRIPT = Path(__file__).with_name("training_flow.py")
TRAINING = {"max_steps": 8, "ttt_steps": 2, "max_length": 96, "checkpoint_every": 2, "holdout_fraction": 0.3}


def run_config(target_dir: Path, run_dir: Path, **training: object) -> PipelineConfig:
    return PipelineConfig.model_validate(
        pinned_dtypes(
            {
                "run_dir": str(run_dir),
                "target": {"model": str(target_dir)},
                "sampling": {"holdout_fraction": 0.0},
                "extraction": {"backend": "hf"},
                "vocab": {"draft_vocab_size": 300},
                "training": {**TRAINING, "processes": 2, **training},
                "orchestration": {"retries": 0},
            }
        )
    )


@dataclass(frozen=True)
class Data:
    """Upstream manifests made once (hf extraction of the tiny target); runs that train on them."""

    root: Path
    target_dir: Path
    target: TargetModel
    hidden: HiddenStateSet
    vocab: VocabMap

    def config(self, name: str, **training: object) -> PipelineConfig:
        return run_config(self.target_dir, self.root / name, **training)

    def config_file(self, config: PipelineConfig) -> Path:
        """The config as a file, outside its run directory."""
        path = self.root / "configs" / f"{config.run_dir.name}.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        return path


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, smollm2_target: TargetModel, tiny_llama: TargetModel) -> Data:
    root = tmp_path_factory.mktemp("launch")
    config = run_config(tiny_llama.root_path, root / "data")
    events = RunEvents(config.run_dir)
    target = prepare_target(config.target, events)  # as the ranks' `eagle3 train` describes it
    samples = build_sample_set(root / "samples", smollm2_target.root_path, num_ok=12)
    hidden = extract_hidden_states(config, samples, target, events)
    return Data(root, tiny_llama.root_path, target, hidden, build_vocab_map(config, samples, target, events))


def weights(checkpoint: DraftCheckpoint) -> dict[str, torch.Tensor]:
    return load_file(checkpoint.path_of(f"{EXPORT}/model.safetensors"))


def test_two_gloo_ranks_train_from_the_flow_as_torchrun_by_hand_does(prefect_api, data: Data) -> None:
    config = data.config("flow")
    state = train_only(config, data.hidden, data.vocab, data.target, return_state=True)
    assert state.is_completed(), state.message
    checkpoint = state.result()
    assert checkpoint.step == TRAINING["max_steps"]
    events = RunEvents(config.run_dir).read()
    [launched] = [e for e in events if "under torchrun" in e["message"]]
    assert launched["processes"] == 2 and "torch.distributed.run" in launched["command"]
    [trained] = [e for e in events if e["message"].startswith("training on ")]
    assert trained["world"] == 2, "rank 0 trained in a world of two"
    logs = RunLayout.of(config).draft.launch / LOGS_DIR
    assert sorted(p.parent.name for p in logs.glob("*/attempt_0/*/stderr.log")) == ["0", "1"], "a log per rank"
    with get_client(sync_client=True) as client:  # the session's server holds other tests' runs too
        flow_run = ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])
        steps = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["training-steps"]), flow_run_id=flow_run)
        )
    assert steps and steps[0].data == 100, "rank 0's progress reached the task's progress artifact"

    by_hand = data.config("by-hand")
    command = [str(BIN / "torchrun"), "--nproc-per-node", "2", str(BIN / "eagle3"), "train"]
    command += ["-c", str(data.config_file(by_hand)), "--hidden-states", data.hidden.root, "--vocab", data.vocab.root]
    subprocess.run(command, cwd=REPO, check=True, timeout=600, capture_output=True)
    reference = DraftCheckpoint.load(RunLayout(by_hand.run_dir).draft.root)
    assert checkpoint.metrics["loss"] == reference.metrics["loss"]
    ours, theirs = weights(checkpoint), weights(reference)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def latest_step(run_dir: Path) -> int:
    latest = RunLayout(run_dir).draft.state / "latest.json"
    return yaml.safe_load(latest.read_text())["step"] if latest.exists() else 0


def processes_of(run_dir: Path) -> list[psutil.Process]:
    """Live processes naming the run directory: the agent and every rank (their config lies under it)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() != psutil.STATUS_ZOMBIE and str(run_dir) in " ".join(process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def test_a_failing_rank_fails_the_training_with_its_error_and_log_tail(data: Data) -> None:
    config = data.config("failing", warm_start=str(data.root / "no-such-drafter"))
    with pytest.raises(RankFailed) as failed:
        train_draft_on_host(config, data.hidden, data.vocab, data.target, RunEvents(config.run_dir))
    message = str(failed.value)
    assert re.match(r"training rank [01] failed: FileNotFoundError: .*no-such-drafter/config.json", message), message
    assert "Traceback (most recent call last)" in message and "stderr.log, " in message and "last lines:" in message
    assert isinstance(failed.value.__cause__, FileNotFoundError) and is_deterministic(failed.value), "not retried"
    assert processes_of(config.run_dir) == [] and not RunLayout.of(config).pid_file("training").exists()


def test_a_killed_flow_leaves_no_rank_and_the_next_run_resumes_at_the_checkpoint(prefect_api, data: Data) -> None:
    max_steps = 60
    config = data.config("killed", max_steps=max_steps, checkpoint_every=4)
    log = open(data.root / "killed.log", "w")  # noqa: SIM115 (closed below)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(FLOW_SCRIPT), str(data.config_file(config)), data.hidden.root, data.vocab.root]
    flow = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while latest_step(config.run_dir) < 4:
            assert flow.poll() is None, (data.root / "killed.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint after 300 s"
            time.sleep(0.1)
        assert len(processes_of(config.run_dir)) == 3, "the agent and two ranks"
        flow.send_signal(signal.SIGKILL)
        assert flow.wait(timeout=30) == -signal.SIGKILL
    finally:
        if flow.poll() is None:
            flow.kill()
        log.close()
    deadline = time.monotonic() + 30
    while (left := processes_of(config.run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], [" ".join(p.cmdline())[:200] for p in left]
    step = latest_step(config.run_dir)  # the ranks may checkpoint once more while their agent stops them
    assert step < max_steps, "killed mid-training"

    started = time.time()
    state = train_only(config, data.hidden, data.vocab, data.target, return_state=True)
    assert state.is_completed(), state.message
    assert state.result().step == max_steps
    resumed = [e for e in RunEvents(config.run_dir).read() if e["event"] == RESUME and e["ts"] >= started]
    assert [e["step"] for e in resumed] == [step], "resumed at the last checkpoint before the kill"


def test_two_nodes_of_one_process_train_what_one_node_of_two_does(data: Data) -> None:
    """A training over `orchestration.hosts: 2` hosts, each node one gloo rank, both nodes on 127.0.0.1: each
    node's `train_draft_on_host` (what its host's child run calls) starts torchrun with `--nnodes 2
    --node-rank i --rdzv-backend c10d` on the first host's rendezvous port. The draft equals the one a single
    node of two processes trains on the same data: the same loss and weights, bit for bit. They differed
    (10.2550001 vs 10.2550097 here) while a node of one process trained on every core, torchrun setting
    OMP_NUM_THREADS=1 only for more than one process a node: not gloo's all-reduce (a sum of two is
    commutative), not the data order or the rank assignment (a rank's data depends on its global rank
    alone), but the thread count of the CPU matmuls; the launch now gives every rank 1 (`rank_env`)."""
    one_node = data.config("one-node")
    reference = train_draft_on_host(one_node, data.hidden, data.vocab, data.target, RunEvents(one_node.run_dir))

    config = data.config("two-nodes", processes=1)
    config = config.model_copy(
        update={
            "orchestration": config.orchestration.model_copy(
                update={"hosts": 2, "rendezvous_host": "127.0.0.1", "rendezvous_port": free_port()}
            )
        }
    )
    with ThreadPoolExecutor(2) as nodes:
        runs = [
            nodes.submit(train_draft_on_host, node, data.hidden, data.vocab, data.target, RunEvents(node.run_dir))
            for node in (on_host(config, 0), on_host(config, 1))
        ]
        checkpoints = [run.result(timeout=300) for run in runs]
    assert [c.digest for c in checkpoints] == [checkpoints[0].digest] * 2, "both nodes return the one checkpoint"
    launched = [e for e in RunEvents(config.run_dir).read() if "under torchrun" in e["message"]]
    assert sorted(e["message"].split(" on node ")[1][:11] for e in launched) == ["0 of 2 (127", "1 of 2 (127"]
    assert [e["world"] for e in RunEvents(config.run_dir).read() if e["message"].startswith("training on ")] == [2]
    assert checkpoints[0].step == reference.step == TRAINING["max_steps"]
    assert checkpoints[0].metrics["loss"] == reference.metrics["loss"]
    ours, theirs = weights(checkpoints[0]), weights(reference)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
