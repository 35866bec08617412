"""The example output of the README's `eagle3 doctor` and `eagle3 plan` sections, regenerated:

    python -m bench.plan_examples

prints `eagle3 doctor -c configs/demo.yaml` on this host, `eagle3 plan` of configs/kimi-k2.5-8gpu.yaml on an
assumed 8 x H100 80GB host and on 8 x H200 (against a Kimi-K2.5-shaped config.json: no checkpoint needed),
and `eagle3 plan` of the demo on this host. Each through the real command line; nothing is written outside a
temporary folder."""

from __future__ import annotations

import tempfile
from pathlib import Path

from typer.testing import CliRunner

from cli.main import app
from tests.helpers.devices import kimi_folder
from tests.helpers.targets import KIMI_TEXT

REPO = Path(__file__).parents[1]
H100 = ["--gpus", "8", "--gpu-memory-gib", "79.6", "--gpu-name", "NVIDIA H100 80GB HBM3"]
H200 = ["--gpus", "8", "--gpu-memory-gib", "140.4", "--gpu-name", "NVIDIA H200"]


def command_output(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    return f"$ eagle3 {' '.join(args)}    # exit {result.exit_code}\n{result.output}"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        kimi = kimi_folder(Path(tmp) / "Kimi-K2.5", KIMI_TEXT)
        kimi_args = ["plan", "-c", "configs/kimi-k2.5-8gpu.yaml", "--set", f"target.model={kimi}"]
        runs = [
            ["doctor", "-c", "configs/demo.yaml"],
            [*kimi_args, *H100],
            [*kimi_args, *H200],
            ["plan", "-c", "configs/demo.yaml"],
        ]
        for args in runs:
            print(command_output(args))


if __name__ == "__main__":
    main()
