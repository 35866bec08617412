"""Measurement (b) in SGLang (`evaluation.engine: sglang`) against a real process: the stand-in of
tests/helpers/sglang_standin, launched by our lifecycle as `<python> -m sglang.launch_server ...`. What a user
relies on: tau is what SGLang's histograms say, departures are counted as for vLLM, the engine is named in
the report and events, keys tell the engines apart without moving vLLM's, and no server is left behind."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import psutil
import pytest

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import VLLM, PipelineConfig
from eagle3_core.evaluation.phase import evaluate_draft, measurement_keys, run_served, served_unavailable
from eagle3_core.evaluation.prompts import EvalPrompt
from eagle3_core.evaluation.served import Measurement
from eagle3_core.evaluation.sglang_measure import histogram_stats, measure_sglang
from eagle3_core.evaluation.stats import AcceptanceStats
from eagle3_core.events import DECISION, ENGINE_START, ENGINE_STOP, RESUME, WEIGHT_LOAD, RunEvents
from eagle3_core.phases import keyed_fields
from eagle3_core.sampling.chat_tokens import ChatTokenizer
from eagle3_core.serving.processes import ServerError
from tests.helpers.evaluation_fixtures import exported_checkpoint, random_draft
from tests.helpers.extraction_fixtures import build_sample_set
from tests.helpers.sglang_standin.sglang import launch_server as standin

STANDIN = Path(__file__).resolve().parents[3] / "helpers" / "sglang_standin"
K, NEW_TOKENS, EVERY = 3, 12, 2
PROMPTS = {
    "humaneval": [EvalPrompt(f"h{i}", "humaneval", (("user", f"def f{i}(x): return x * {i}"),)) for i in range(6)],
    "holdout": [EvalPrompt(f"o{i}", "holdout", (("user", f"Why is the sky {i} times blue?"),)) for i in range(6)],
}


def make_config(run_dir: Path, env: dict[str, str] | None = None, **evaluation) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "run_dir": str(run_dir),
        "server": {"stop_grace_s": 5, "startup_timeout_s": 60},
        "sampling": {"holdout_fraction": 0.5},
        "evaluation": {"engine": "sglang", "num_speculative_tokens": K, "max_new_tokens": NEW_TOKENS,
                       "concurrency": 2, "max_prompts": 4, "with_transformers": False,
                       "sglang_env": {"PYTHONPATH": str(STANDIN), **(env or {})}, **evaluation},
    })  # fmt: skip


def seeds(target: TargetModel, prompts: list[EvalPrompt]) -> dict[str, int]:
    tokenizer = ChatTokenizer(target.root_path)
    return {p.id: standin.fingerprint(tokenizer.prompt_ids(p.chat_messages())) for p in prompts}


def server_processes(run_dir: Path) -> list[int]:
    """Every pid a stand-in server of this run had: the servers (events) and their schedulers (logs)."""
    events = RunEvents(run_dir).read()
    pids = [event["pid"] for event in events if event["event"] == ENGINE_START]
    logs = "".join(path.read_text() for path in (run_dir / "server").glob("*.log"))
    return pids + [int(pid) for pid in re.findall(r"scheduler pid (\d+)", logs)]


def assert_all_stopped(run_dir: Path) -> None:
    pids = server_processes(run_dir)
    assert pids, "no server was started"
    alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive and not list((run_dir / "server").glob("*.pid"))


def test_tau_is_what_the_histograms_say_and_departures_are_judged(tiny_llama: TargetModel, tmp_path: Path) -> None:
    config = make_config(tmp_path, {"SGLANG_STANDIN_DEPART_EVERY": str(EVERY)})
    events = RunEvents(tmp_path)
    result = measure_sglang(Measurement(config, tiny_llama.root_path, tmp_path / "draft", PROMPTS, events))

    every = [p for ps in PROMPTS.values() for p in ps]
    by_id = seeds(tiny_llama, every)
    expected = AcceptanceStats(K)
    for seed in by_id.values():
        expected = expected.merge(AcceptanceStats.from_histogram(K, standin.histogram(seed, NEW_TOKENS, K)))
    pooled = result["sets"]["all"]
    assert result["engine"] == "sglang" and result["k"] == K
    assert pooled["acceptance"] == expected.to_json()
    departing = [pid for pid, seed in by_id.items() if standin.departs(seed, EVERY)]
    ties = [pid for pid in departing if standin.near_tie(by_id[pid], EVERY)]
    assert 0 < len(ties) < len(departing) < len(every), "the planted departures cover every case"
    assert pooled["identical_outputs"] == f"{len(every) - len(departing)}/{len(every)}"
    assert pooled["near_ties"] == len(ties)
    assert sorted(pooled["defects"]) == sorted(set(departing) - set(ties))
    assert pooled["batch1"]["plain"]["tokens"] == len(every) * NEW_TOKENS and pooled["batch1"]["speedup"] > 0
    lines = [event for event in events.read() if event["event"] in (ENGINE_START, ENGINE_STOP, DECISION)]
    assert [e["event"] for e in lines] == [ENGINE_START, ENGINE_STOP, ENGINE_START, ENGINE_STOP, DECISION]
    assert all("SGLang server" in e["message"] for e in lines[:4])
    assert lines[-1]["message"].startswith("measurement (b) in SGLang, outputs with the draft vs plain greedy")
    draft_command = lines[0]["command"]
    assert draft_command[1:3] == ["-m", "sglang.launch_server"] and "--dtype" in draft_command
    assert draft_command[draft_command.index("--speculative-num-draft-tokens") + 1] == str(K + 1)
    assert "--speculative-algorithm" not in lines[2]["command"]
    loads = [e for e in events.read() if e["event"] == WEIGHT_LOAD]
    assert len(loads) == 2 and loads[0]["source"] == "log" and loads[0]["seconds"] == 0.25
    assert_all_stopped(tmp_path)


def test_a_failing_request_still_stops_the_server(tiny_llama: TargetModel, tmp_path: Path) -> None:
    config = make_config(tmp_path, {"SGLANG_STANDIN_FAIL": "1"})
    with pytest.raises(RuntimeError, match="HTTP 500"):
        measure_sglang(Measurement(config, tiny_llama.root_path, tmp_path / "draft", PROMPTS, RunEvents(tmp_path)))
    kinds = [e["event"] for e in RunEvents(tmp_path).read() if e["event"] in (ENGINE_START, ENGINE_STOP)]
    assert kinds == [ENGINE_START, ENGINE_STOP]
    assert_all_stopped(tmp_path)


def test_a_cut_after_the_draft_pass_resumes_with_only_the_plain_server(tiny_llama: TargetModel, tmp_path: Path) -> None:
    kept = (tmp_path / "eval" / "served-with-draft.json", "key-1")
    config = make_config(tmp_path, {"SGLANG_STANDIN_FAIL": "plain"})
    with pytest.raises(RuntimeError, match="HTTP 500"):
        measure_sglang(
            Measurement(
                config, tiny_llama.root_path, tmp_path / "draft", PROMPTS, RunEvents(tmp_path), with_draft_file=kept
            )
        )
    assert kept[0].is_file()
    before = len(RunEvents(tmp_path).read())
    config = make_config(tmp_path)
    result = measure_sglang(
        Measurement(
            config, tiny_llama.root_path, tmp_path / "draft", PROMPTS, RunEvents(tmp_path), with_draft_file=kept
        )
    )
    fresh = measure_sglang(
        Measurement(config, tiny_llama.root_path, tmp_path / "draft", PROMPTS, RunEvents(tmp_path / "fresh"))
    )
    after = RunEvents(tmp_path).read()[before:]
    starts = [e for e in after if e["event"] == ENGINE_START]
    assert len(starts) == 1 and "--speculative-algorithm" not in starts[0]["command"]
    assert any(e["event"] == RESUME and "only plain greedy is left" in e["message"] for e in after)
    assert result["sets"]["all"]["acceptance"] == fresh["sets"]["all"]["acceptance"]
    assert result["sets"]["all"]["identical_outputs"] == fresh["sets"]["all"]["identical_outputs"]
    assert_all_stopped(tmp_path)


def free_port_above(lowest: int) -> int:
    for port in range(lowest, 65536):
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return port
    raise RuntimeError(f"no free port above {lowest}")


def test_a_server_on_a_port_above_55535_starts(tiny_llama: TargetModel, tmp_path: Path) -> None:
    """SGLang 0.5.14 puts its gRPC server on `--port` + 10000 unless SGLANG_GRPC_PORT is set, and refuses to
    start past 65535 (the stand-in too): the H200's run drew port 57603 and its server died starting."""
    config = make_config(tmp_path)
    config.server = config.server.model_copy(update={"port": free_port_above(55536)})
    result = measure_sglang(Measurement(config, tiny_llama.root_path, tmp_path / "draft", PROMPTS, RunEvents(tmp_path)))
    assert result["sets"]["all"]["acceptance"]["drafts"] > 0
    assert_all_stopped(tmp_path)


def test_a_server_that_exits_while_starting_fails_with_its_log(tiny_llama: TargetModel, tmp_path: Path) -> None:
    config = make_config(tmp_path, sglang_args=["--no-such-flag"])
    with pytest.raises(ServerError, match=r"SGLang server exited with code 2 while starting(.|\n)*--no-such-flag"):
        measure_sglang(Measurement(config, tiny_llama.root_path, tmp_path / "draft", PROMPTS, RunEvents(tmp_path)))
    assert_all_stopped(tmp_path)


def test_sglang_unavailable_skips_b_with_the_reason(tiny_llama: TargetModel, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    config.evaluation.sglang_env = {}
    reason = served_unavailable(config)
    assert reason is not None and "sglang is not importable by" in reason
    events = RunEvents(tmp_path)
    assert run_served(config, tiny_llama, tmp_path, PROMPTS, "key", tmp_path, events, print) == {"skipped": reason}
    assert events.read()[-1]["message"] == f"measurement (b) skipped: {reason}"
    config.evaluation.sglang_python = str(tmp_path / "no-python")
    assert "cannot run" in served_unavailable(config)
    config.server.engine = "external"
    assert served_unavailable(config).startswith("server.engine is external")


def test_the_phase_measures_in_sglang_and_the_report_names_it(tiny_llama: TargetModel, tmp_path: Path) -> None:
    sample_set = build_sample_set(tmp_path / "samples", tiny_llama.root_path, num_ok=8)
    checkpoint = exported_checkpoint(random_draft(tiny_llama, draft_vocab=256), tmp_path / "draft")
    config = make_config(tmp_path / "run", prompt_sets=["holdout"])
    report = evaluate_draft(config, checkpoint, tiny_llama, sample_set, RunEvents(tmp_path / "run"))
    measured = AcceptanceStats.from_json(report.measurements["vllm"]["sets"]["all"]["acceptance"])
    assert report.measurements["vllm"]["engine"] == "sglang"
    assert report.vllm_acceptance_length == measured.acceptance_length > 1
    text = (report.root_path / "report.md").read_text()
    assert "(b) SGLang, served with the draft" in text and "(b) SGLang τ at k=3" in text and "vLLM τ" not in text
    assert_all_stopped(tmp_path / "run")


def test_keys_tell_the_engines_apart_and_vllm_keys_are_unchanged_at_default(tmp_path: Path) -> None:
    vllm = PipelineConfig.model_validate({"run_dir": str(tmp_path)})
    sglang = vllm.model_copy(deep=True)
    sglang.evaluation.engine = "sglang"
    prompts = {"holdout": PROMPTS["holdout"]}
    (a_vllm, b_vllm), (a_sglang, b_sglang) = measurement_keys(vllm, {}, prompts), measurement_keys(sglang, {}, prompts)
    assert a_vllm == a_sglang and b_vllm != b_sglang  # (a) is reused; (b) is measured again
    new = {"engine", "sglang_python", "sglang_args", "sglang_env", "sglang_dtype"}
    assert not new & set(keyed_fields(vllm, "evaluation", (VLLM,)).get("evaluation", {}))
    sglang.evaluation.sglang_env = {"PYTHONPATH": "/elsewhere"}  # where SGLang lives is not what it measures
    assert measurement_keys(sglang, {}, prompts)[1] == b_sglang


def test_histograms_must_be_there_and_add_up() -> None:
    assert AcceptanceStats.from_histogram(3, [1, 2, 0, 1]).accepted == [3, 1, 1]
    metas = [{"spec_correct_drafts_histogram": [2, 1, 0, 1]}, {"spec_accept_histogram": [1, 1, 2, 0]}]  # older name
    stats = histogram_stats(metas, 3)
    assert stats.drafts == 8 and stats.per_position == [5 / 8, 3 / 8, 1 / 8] and stats.acceptance_length == 1 + 9 / 8
    with pytest.raises(ValueError, match="more than k=2"):
        AcceptanceStats.from_histogram(2, [0, 0, 0, 1])
    with pytest.raises(ValueError, match="no draft ran"):
        histogram_stats([{"completion_tokens": 4}], 3)
    with pytest.raises(ValueError, match="spec_verify_ct 5"):
        histogram_stats([{"spec_verify_ct": 5, "spec_correct_drafts_histogram": [1, 1]}], 3)


def test_a_draft_with_a_flag_sglang_does_not_read_is_refused_before_any_engine(tiny_llama, tmp_path) -> None:
    """(b) in SGLang would measure another layer than the one trained: refused with one line naming the flag,
    before (a) loads the target or any server starts; from the CLI one `error:` line, exit status 1."""
    from dataclasses import replace

    from typer.testing import CliRunner

    from cli.main import app
    from eagle3_core.draft.model import Eagle3Draft
    from eagle3_core.preflight import PreflightError

    draft = random_draft(tiny_llama, draft_vocab=256)
    flagged = Eagle3Draft(replace(draft.config, norm_before_residual=True))
    flagged.load_state_dict(draft.state_dict(), strict=False)
    checkpoint = exported_checkpoint(flagged, tmp_path / "draft")
    sample_set = build_sample_set(tmp_path / "samples", tiny_llama.root_path, num_ok=8)
    config = make_config(tmp_path / "run", prompt_sets=["holdout"], with_transformers=True)
    with pytest.raises(PreflightError, match=r"trained with norm_before_residual, which SGLang does not read") as err:
        evaluate_draft(config, checkpoint, tiny_llama, sample_set, RunEvents(tmp_path / "run"))
    assert "\n" not in str(err.value) and "export.engines: [vllm, sglang]" in str(err.value)
    events = RunEvents(tmp_path / "run").read()
    assert not [e for e in events if e["event"] in (ENGINE_START, WEIGHT_LOAD)]

    args = ["evaluate", "--draft", str(tmp_path / "draft"), "--set", f"run_dir={tmp_path / 'cli'}",
            "--set", f"target.model={tiny_llama.root}", "--set", "evaluation.engine=sglang",
            "--set", f"evaluation.sglang_env={{PYTHONPATH: {STANDIN}}}"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    error = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "norm_before_residual" in error[0] and "Traceback" not in result.output
