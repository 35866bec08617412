"""Serve-and-extract on one server, the parts that need no vLLM server: the `auto` decision and the shared
server's lifetime (with stand-in servers). The connector's request filter is tested with the connector
(tests/unit/eagle3_core/extraction/test_connector.py)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3_core.config import ConfigError, PipelineConfig
from eagle3_core.events import DECISION, PREFLIGHT, WEIGHT_LOAD, RunEvents
from eagle3_core.preflight import PreflightError
from eagle3_core.sampling.phase import sample_prompts
from eagle3_core.sampling.prompts import load_prompts
from eagle3_core.sampling.reuse_decision import (
    estimate_reuse,
    last_engine_start_s,
    last_seconds_per_request,
    pending_requests,
    resolve_reuse,
    reuse_saves_time,
    sampling_slowdown_s,
)
from eagle3_core.sampling.store import SampleStore
from eagle3_core.serving.shared import CONTEXT_MARGIN, SharedServer, conversation_tokens, running_server, starts_engine
from tasks.shared_server import sampling_and_extraction_server

# --- auto: the saved engine start against the slower sampling -----------------------------------------


def test_reuse_pays_when_the_saved_load_outweighs_the_slower_sampling():
    assert sampling_slowdown_s(300, 0.25) == pytest.approx(100)
    assert reuse_saves_time(load_s=1467, sampling_s=600, penalty=0.25)
    assert not reuse_saves_time(load_s=30, sampling_s=600, penalty=0.25)
    assert reuse_saves_time(load_s=1, sampling_s=10_000, penalty=0.0), "no penalty: always one load"
    assert reuse_saves_time(load_s=30, sampling_s=0, penalty=0.9), "nothing to sample: always one load"


def load_event(model_dir: str, seconds: float, startup_s: float) -> dict:
    what = f"vLLM server {model_dir}"
    return {"phase": "sampling", "event": WEIGHT_LOAD, "what": what, "seconds": seconds, "startup_s": startup_s}


def test_history_gives_the_last_engine_start_of_this_target_and_the_seconds_per_prompt():
    events = [
        load_event("/models/a", 20, 31),
        load_event("/models/b", 900, 950),
        {"phase": "sampling", "event": DECISION, "message": "sampled", "prompts": 10, "seconds": 50.0},
        load_event("/models/a", 22, 35),
        {"phase": "sampling", "event": DECISION, "message": "sampled", "prompts": 4, "seconds": 8.0},
        {"phase": "sampling", "event": DECISION, "message": "parameters changed"},
    ]
    assert last_engine_start_s(events, Path("/models/a")) == 35
    assert last_engine_start_s(events, Path("/models/c")) is None
    assert last_seconds_per_request(events) == 2.0
    assert last_seconds_per_request(events[:2]) is None


def small_config(tmp_path: Path, mode: str, **extraction: object) -> PipelineConfig:
    return PipelineConfig(
        run_dir=tmp_path / "run",
        sampling={"max_prompts": 20, "max_tokens": 100},
        extraction={"reuse_sampling_server": mode, "reuse_generation_penalty": 0.5, **extraction},
    )


def test_without_history_auto_estimates_from_the_start_up_cost_weights_size_and_assumed_rate(tmp_path, smollm2_target):
    config = small_config(
        tmp_path, "auto", reuse_load_gb_per_s=0.001, reuse_generation_tokens_per_s=100, reuse_engine_start_s=7
    )
    estimate = estimate_reuse(config, smollm2_target, [])
    size = sum(p.stat().st_size for p in smollm2_target.root_path.glob("*.safetensors"))
    assert estimate.load_s == pytest.approx(7 + size / 1e6), "fixed start-up + weights at the bandwidth"
    assert "no engine start in events.jsonl" in estimate.load_source
    assert estimate.sampling_s == pytest.approx(20 * 100 / 100), "20 prompts of 100 tokens at 100 tokens/s"
    assert estimate.slowdown_s == pytest.approx(20)
    assert estimate.reuse


def test_only_prompts_without_an_ok_row_of_the_same_parameters_count_as_pending(tmp_path, smollm2_target):
    config = small_config(tmp_path, "auto")
    assert pending_requests(config, smollm2_target) == 20, "nothing sampled yet"
    prompts = load_prompts(config.sampling.prompt_files, config.sampling.max_prompts)
    store = SampleStore.of_run(config, smollm2_target, prompts, RunEvents(config.run_dir))
    store.resume(set())
    writer = store.writer(rows_per_part=2)
    for prompt, status in zip(prompts, ["ok", "ok", "error", "skipped"], strict=False):
        writer.add({"id": prompt.id, "messages": prompt.messages, "status": status})
    writer.flush()
    assert pending_requests(config, smollm2_target) == 18
    longer = config.model_copy(update={"sampling": config.sampling.model_copy(update={"max_tokens": 200})})
    assert pending_requests(longer, smollm2_target) == 20, "rows made with other parameters are not kept"


def test_auto_records_its_choice_with_the_numbers(tmp_path, smollm2_target):
    config = small_config(tmp_path, "auto")
    events = RunEvents(config.run_dir)
    events.record("sampling", WEIGHT_LOAD, "", what=f"vLLM server {smollm2_target.root_path}", seconds=5, startup_s=30)
    events.record("sampling", DECISION, "sampled", prompts=20, seconds=100.0)
    assert not resolve_reuse(config, smollm2_target, events), "30 s saved < 100 s slower sampling"
    decision = events.read()[-1]
    assert decision["event"] == DECISION and decision["reuse"] is False
    assert decision["load_s"] == 30 and decision["sampling_s"] == 100 and decision["slowdown_s"] == 100
    assert decision["load_source"] == "last engine start in events.jsonl"
    assert "separate engines" in decision["message"]

    events.record("sampling", WEIGHT_LOAD, "", what=f"vLLM server {smollm2_target.root_path}", seconds=5, startup_s=500)
    assert resolve_reuse(config, smollm2_target, events)
    assert "one shared server" in events.read()[-1]["message"]


def test_auto_without_recorded_starts_counts_the_default_start_up_not_the_weights_alone(tmp_path, smollm2_target):
    """Issue 14: SmolLM2's 0.27 GB at 0.37 GB/s said "engine start 1 s"; its engine took 61-76 s to be healthy."""
    config = small_config(tmp_path, "auto", reuse_generation_tokens_per_s=300)
    estimate = estimate_reuse(config, smollm2_target, [])
    assert estimate.load_s == pytest.approx(config.extraction.reuse_engine_start_s + 0.27 / 0.37, abs=0.1)
    assert estimate.load_s > 60
    assert estimate.reuse, "20 prompts of 100 tokens: ~7 s of sampling, 3.3 s slower, against a 61 s start"


def test_off_decides_nothing_on_shares_and_only_a_vllm_pair_can_share(tmp_path, smollm2_target):
    events = RunEvents(tmp_path / "run")
    assert not resolve_reuse(small_config(tmp_path, "off"), smollm2_target, events)
    assert events.read() == []
    assert resolve_reuse(small_config(tmp_path, "on"), smollm2_target, events)
    with pytest.raises(ConfigError, match=r"extraction\.backend 'vllm'"):
        resolve_reuse(small_config(tmp_path, "on", backend="hf"), smollm2_target, events)
    assert not resolve_reuse(small_config(tmp_path, "auto", backend="hf"), smollm2_target, events)
    assert "separate engines" in events.read()[-1]["message"]


# --- the shared server's lifetime -------------------------------------------------------------------


class StandInServer:
    def __init__(self, context: int):
        self.context = context
        self.base_url, self.api_key = f"http://127.0.0.1/{context}", None
        self.process = SimpleNamespace(poll=lambda: None)
        self.stopped = False

    def healthy(self) -> bool:
        return not self.stopped

    def stop(self) -> None:
        self.stopped = True


class Recorder:
    """Launches stand-in servers and tracks the slot the shared server holds."""

    def __init__(self):
        self.launched: list[StandInServer] = []
        self.slot: list[str] = []

    def launch(self, phase: str, progress, context: int) -> StandInServer:
        self.launched.append(StandInServer(context))
        return self.launched[-1]

    @contextmanager
    def hold(self):
        self.slot.append("taken")
        yield
        self.slot.append("released")


def test_the_server_starts_on_first_use_once_and_releases_the_slot_after_stopping(tmp_path):
    recorder = Recorder()
    shared = SharedServer(recorder.launch, 100, RunEvents(tmp_path), recorder.hold)
    assert recorder.launched == [] and recorder.slot == [], "nothing runs before a phase has work"
    first = shared.running("sampling")
    assert shared.running("extraction", context=100) is first
    assert len(recorder.launched) == 1 and recorder.slot == ["taken"]
    shared.stop()
    assert first.stopped and recorder.slot == ["taken", "released"]
    shared.stop()
    assert recorder.slot == ["taken", "released"], "stopping twice is harmless"


def test_a_dead_or_too_short_server_is_started_again_under_the_same_slot(tmp_path):
    recorder = Recorder()
    events = RunEvents(tmp_path)
    shared = SharedServer(recorder.launch, 100, events, recorder.hold)
    first = shared.running("sampling")
    first.process = SimpleNamespace(poll=lambda: -9)  # the engine died
    second = shared.running("extraction")
    assert second is not first and first.stopped
    wider = shared.running("extraction", context=180)
    assert wider is not second and second.stopped and wider.context == 180
    assert [e["message"].split(";")[0] for e in events.read()] == [
        "shared vLLM server is not alive",
        "shared vLLM server holds 100 tokens, 180 needed",
    ]
    shared.stop()
    assert recorder.slot == ["taken", "released"]


def test_a_failed_start_still_releases_the_slot(tmp_path):
    recorder = Recorder()

    def failing(phase, progress, context):
        raise RuntimeError("engine failed to start")

    shared = SharedServer(failing, 100, RunEvents(tmp_path), recorder.hold)
    with pytest.raises(RuntimeError):
        shared.running("sampling")
    shared.stop()
    assert recorder.slot == ["taken", "released"]


def test_a_server_handed_in_running_is_used_as_it_is():
    server = StandInServer(64)
    assert running_server(server, "extraction", context=10_000) is server


def test_the_flow_gets_no_shared_server_when_off_and_an_unstarted_one_when_on(tmp_path, smollm2_target):
    with sampling_and_extraction_server(small_config(tmp_path, "off"), smollm2_target) as shared:
        assert shared is None
    config = small_config(tmp_path, "on")
    with sampling_and_extraction_server(config, smollm2_target) as shared:
        assert isinstance(shared, SharedServer) and shared.server is None
        assert shared.context == config.server.max_model_len + 16
    assert not list((config.run_dir / "server").glob("*.pid")), "cached phases never start it"
    assert json.loads((config.run_dir / "events.jsonl").read_text().splitlines()[-1])["event"] == DECISION


def test_conversations_leave_the_margin_inside_the_targets_own_context():
    assert conversation_tokens(2048, 8192) == 2048
    assert conversation_tokens(2048, None) == 2048, "a config.json without max_position_embeddings"
    assert conversation_tokens(2048, 2048) == 2048 - CONTEXT_MARGIN
    assert conversation_tokens(4096, 2048) == 2048 - CONTEXT_MARGIN


def test_the_shared_server_of_a_2048_token_target_asks_vllm_for_no_more_than_2048(tmp_path, tiny_llama):
    """Seen with the tiny Llama (max_position_embeddings 2048, the default server.max_model_len): the shared
    server asked for 2064 tokens and vLLM refused to start, three attempts over 90 s, in a traceback."""
    config = small_config(tmp_path, "on")
    with sampling_and_extraction_server(config, tiny_llama) as shared:
        assert shared.context == tiny_llama.context_tokens == config.server.max_model_len == 2048


def test_the_phase_that_starts_the_shared_server_runs_the_engine_checks(tmp_path, smollm2_target):
    """Seen on two H200s: with reuse on, sampling's preflight said `gpus 0` and checked no engine setting, so
    tensor parallelism 2 over SmolLM2's 9 heads failed only in vLLM, after its workers were up."""
    recorder = Recorder()
    config = PipelineConfig(run_dir=tmp_path / "run", sampling={"max_prompts": 2}, server={"tensor_parallel_size": 2})
    events = RunEvents(config.run_dir)
    shared = SharedServer(recorder.launch, 100, events, recorder.hold)
    assert starts_engine(None) and starts_engine(shared)
    with pytest.raises(PreflightError, match=r"server\.tensor_parallel_size 2 does not divide"):
        sample_prompts(config, smollm2_target, events, server=shared)
    assert recorder.launched == [], "refused before the start"
    [line] = [e for e in events.read() if e["event"] == PREFLIGHT]
    assert line["phase"] == "sampling" and not line["ok"]
    shared.running("sampling")
    assert not starts_engine(shared), "a running shared server was checked by the phase that started it"
    assert not starts_engine(StandInServer(64)), "nor is a server handed in running"
