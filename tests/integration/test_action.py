"""The reusable GitHub Action (`action.yml`): valid as GitHub reads it, and its gate step, run
by bash as the runner would, passes the gate's exit code and leaves the files it uploads."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def _action() -> dict[str, Any]:
    loaded = yaml.safe_load((REPO / "action.yml").read_text())
    assert isinstance(loaded, dict)
    return loaded


def _gate_step() -> dict[str, Any]:
    [step] = [s for s in _action()["runs"]["steps"] if s.get("id") == "gate"]
    return step


def test_the_action_is_a_composite_action_with_the_gate_inputs() -> None:
    action = _action()
    assert action["name"] and action["description"]
    assert action["runs"]["using"] == "composite"
    assert {"sql", "backend", "seeds", "only"} <= set(action["inputs"])
    for name, spec in action["inputs"].items():
        assert spec.get("description"), name
        assert "default" in spec and isinstance(spec["default"], str), name
    # Composite steps that run a script must name their shell.
    for step in action["runs"]["steps"]:
        assert "uses" in step or step.get("shell") == "bash", step
    uploads = [s for s in action["runs"]["steps"]
               if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    assert len(uploads) == 1 and uploads[0]["if"] == "always()"
    assert action["outputs"]["exit-code"]["value"] == "${{ steps.gate.outputs.exit-code }}"


def _run_gate_step(tmp_path: Path, inputs: dict[str, str]) -> tuple[int, str, Path]:
    """The gate step's script with its inputs as the runner would set them."""
    step = _gate_step()
    defaults = {k: v["default"] for k, v in _action()["inputs"].items()}
    values = {**defaults, **inputs}
    env = dict(os.environ)
    for var, expression in step["env"].items():
        name = expression.removeprefix("${{ inputs.").removesuffix(" }}")
        env[var] = values[name]
    output = tmp_path / "github_output"
    output.touch()
    env["GITHUB_OUTPUT"] = str(output)
    done = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=280, check=False)
    return done.returncode, output.read_text(), tmp_path / values["out"]


def test_the_gate_step_passes_and_leaves_what_it_uploads(tmp_path: Path, pg_dsn: str) -> None:
    code, output, out = _run_gate_step(
        tmp_path, {"only": "noisy-neighbour", "seed": "1", "dsn": pg_dsn})
    assert code == 0 and output.strip() == "exit-code=0"
    upload = next(s for s in _action()["runs"]["steps"] if "upload-artifact" in s.get("uses", ""))
    for line in upload["with"]["path"].splitlines():
        path = Path(line.replace("${{ inputs.out }}", str(out)))
        assert path.is_file(), f"the action uploads {line}, which the gate did not write"


def test_the_gate_step_fails_with_the_gates_exit_code(tmp_path: Path) -> None:
    code, output, _ = _run_gate_step(tmp_path, {"seeds": "0"})
    assert code == 2 and output.strip() == "exit-code=2"
