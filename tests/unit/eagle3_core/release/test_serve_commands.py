"""`eagle3 serve`'s plan, without an engine: the k it serves (the fastest of the evaluation's sweep, else the k
evaluated, else 3), the command it prints being the very argv the lifecycle starts (vLLM and SGLang), that
command run by a real shell with the API key taken from its variable and never written, and the refusals."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_core.artifacts import EvalReport
from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.release.commands import DEFAULT_K, ServeCommand, fastest_k, modelled_speeds
from eagle3_core.release.serve import engine_server, export_folder, keep_script, plan
from eagle3_core.serving.engine import ServerError
from tests.helpers.drafts import seeded_draft, tiny_config

TARGET = Path("/models/target")


def sweep_report(tau_by_k: list[float], draft_s: float, target_s: float, steps: int = 100) -> EvalReport:
    """A report whose measurement (a) ran at k = len(tau_by_k) over `steps` steps with these seconds."""
    k = len(tau_by_k)
    pooled = {"acceptance": {"k": k, "drafts": steps, "accepted": [0] * k}, "tau_by_k": tau_by_k,
              "draft_s": draft_s, "target_s": target_s}  # fmt: skip
    return EvalReport(root="/nowhere", num_speculative_tokens=3,
                      measurements={"transformers": {"sets": {"all": pooled}}, "vllm": {}})  # fmt: skip


def test_the_fastest_k_weighs_acceptance_against_the_draft_passes_it_costs() -> None:
    tau = [1.6, 2.0, 2.2, 2.3, 2.35]
    # 100 steps: the target 1 s a step, a draft pass 0.1 s -> tokens/s = tau(k) / (1 + 0.1 k)
    cheap = sweep_report(tau, draft_s=100 * 5 * 0.1, target_s=100 * 1.0)
    expected = [t / (1 + 0.1 * k) for k, t in enumerate(tau, start=1)]
    assert modelled_speeds(cheap.measurements["transformers"]["sets"]["all"]) == pytest.approx(expected)
    choice = fastest_k(cheap)
    assert choice.k == 1 + max(range(5), key=lambda i: expected[i]) == 3
    assert choice.reason.startswith("k = 3: fastest of k = 1..5") and "τ 2.200" in choice.reason
    # A draft pass as dear as the target's step: one draft token a step is fastest.
    assert fastest_k(sweep_report(tau, draft_s=100 * 5 * 1.0, target_s=100 * 1.0)).k == 1


def test_without_a_sweep_the_evaluated_k_and_without_a_report_3() -> None:
    assert fastest_k(None).k == DEFAULT_K == 3
    only_b = EvalReport(root="/nowhere", num_speculative_tokens=4, measurements={"transformers": {"sets": {}}})
    assert fastest_k(only_b).k == 4


@pytest.fixture
def export_dir(tmp_path: Path) -> Path:
    """A real export folder of a tiny draft (the default recipe's flags off, as `tiny_config` makes it)."""
    from eagle3_core.draft.export import export_draft

    folder = tmp_path / "draft" / "export"
    export_draft(seeded_draft(tiny_config()), folder)
    return folder


def test_the_printed_command_is_what_the_lifecycle_starts(tmp_path: Path, export_dir: Path) -> None:
    config = PipelineConfig.model_validate({"run_dir": str(tmp_path), "server": {"port": 0, "dtype": "float32"}})
    events = RunEvents(tmp_path)
    for engine in ("vllm", "sglang"):
        fixed, served = plan(config, engine, TARGET, export_dir, k=None)
        assert fixed.server.port > 0 and str(fixed.server.port) in served.command.argv  # a free port, named
        server = engine_server(fixed, served, TARGET, export_dir, events, print)
        assert server.command() == served.command.argv, engine
        assert served.choice.k == 3 and served.script == export_dir / f"serve-{engine}.sh"
    argv = plan(config, "vllm", TARGET, export_dir)[1].command.argv
    speculative = json.loads(argv[argv.index("--speculative-config") + 1])
    assert speculative == {"method": "eagle3", "model": str(export_dir), "num_speculative_tokens": 3}
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--dtype") + 1] == "float32"
    sglang = plan(config, "sglang", TARGET, export_dir, k=2)[1].command.argv
    assert sglang[sglang.index("--speculative-num-steps") + 1] == "2" and "EAGLE3" in sglang


def echo_command(engine: str, env: dict[str, str], **key: str) -> ServeCommand:
    """A command of the shape `serve_command` builds whose program prints what it was started with."""
    show = "import json, os, sys; print(json.dumps([os.environ.get('VLLM_API_KEY'), os.environ.get('A'), sys.argv]))"
    argv = [sys.executable, "-c", show, "--speculative-config", '{"model": "/d i r", "k": 3}']
    return ServeCommand(engine, argv, env, **key)  # type: ignore[arg-type]


def test_a_shell_runs_the_line_as_built_and_the_key_comes_from_its_variable(tmp_path: Path) -> None:
    vllm = echo_command("vllm", {"A": "x y"}, key_variable="MY_KEY", key_env="VLLM_API_KEY")
    line = vllm.shell()
    assert "s3cret" not in line and 'VLLM_API_KEY="$MY_KEY"' in line
    env = {"PATH": "/usr/bin:/bin", "MY_KEY": "s3cret"}
    done = subprocess.run(["sh", "-c", line], capture_output=True, text=True, env=env, check=True)
    key, a, argv = json.loads(done.stdout)
    assert (key, a) == ("s3cret", "x y") and argv[1:] == vllm.argv[3:]
    script = tmp_path / "serve.sh"
    script.write_text(vllm.script("two\nlines"))
    script.chmod(0o755)
    assert json.loads(subprocess.run([str(script)], capture_output=True, text=True, env=env).stdout)[0] == "s3cret"
    sglang = echo_command("sglang", {}, key_variable="MY_KEY", key_flag="--api-key")
    _, _, argv = json.loads(
        subprocess.run(["sh", "-c", sglang.shell()], capture_output=True, text=True, env=env).stdout
    )
    assert argv[-2:] == ["--api-key", "s3cret"] and "s3cret" not in sglang.shell()


def test_the_vllm_command_names_the_configured_key_variable_and_what_it_sets(tmp_path, export_dir, monkeypatch):
    monkeypatch.setenv("SERVE_KEY", "s3cret")
    config = PipelineConfig.model_validate({"run_dir": str(tmp_path), "server": {"api_key_env": "SERVE_KEY"}})
    _, served = plan(config, "vllm", TARGET, export_dir)
    line = served.command.shell()
    words = shlex.split(line.replace('"$SERVE_KEY"', "KEY"))
    assert words[0] == "env" and "VLLM_API_KEY=KEY" in words and "VLLM_CPU_KVCACHE_SPACE=2" in words
    assert "HF_HUB_OFFLINE=1" in words and "s3cret" not in line
    script = keep_script(served, TARGET, export_dir)
    assert script.stat().st_mode & 0o111 and "s3cret" not in script.read_text() and line in script.read_text()


def test_sglang_refuses_a_draft_it_would_serve_as_another_layer_and_a_key_on_its_command_line(tmp_path: Path) -> None:
    from dataclasses import replace

    from eagle3_core.draft.export import export_draft

    folder = tmp_path / "export"
    export_draft(seeded_draft(replace(tiny_config(), norm_before_residual=True)), folder)
    config = PipelineConfig.model_validate({"run_dir": str(tmp_path)})
    with pytest.raises(ServerError, match=r"trained with norm_before_residual, which SGLang does not read") as err:
        plan(config, "sglang", TARGET, folder)
    assert "\n" not in str(err.value)
    plan(config, "vllm", TARGET, folder)  # vLLM reads every flag
    keyed = PipelineConfig.model_validate({"run_dir": str(tmp_path), "server": {"api_key_env": "K"}})
    clean = tmp_path / "clean"
    export_draft(seeded_draft(tiny_config()), clean)
    with pytest.raises(ServerError, match="--api-key"):
        plan(keyed, "sglang", TARGET, clean)


def test_the_draft_folder_is_found_from_the_run_draft_or_the_export(export_dir: Path, tmp_path: Path) -> None:
    assert export_folder(export_dir.parent) == export_folder(export_dir) == export_dir
    with pytest.raises(FileNotFoundError, match="no exported draft"):
        export_folder(tmp_path / "nothing")
