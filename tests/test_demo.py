"""The ``python -m spmd demo`` job: in-process, and as a fresh process that sets up its devices.
Short runs (the tiny model, a few steps); the default run is the README's first command."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmd.demo import DemoOptions, run_demo

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["--size", "tiny", "--steps", "12"]


def test_run_demo(capsys: pytest.CaptureFixture[str]) -> None:
  assert run_demo(DemoOptions(size="tiny", steps=30, strategy="megatron", sample_chars=8)) == 0
  out = capsys.readouterr().out
  assert "strategy 'megatron' on 8 cpu devices {'data': 2, 'model': 4}" in out
  assert "spmd plan for step on mesh (data=2, model=4)" in out
  assert "all-reduce" in out and "params + optimizer state per device" in out
  assert "step 0: loss" in out and "step 1: loss" in out and "sample: 'The cat " in out
  assert "\nOK: 30 partitioned training steps on 8 cpu devices" in out


def _demo(*args: str) -> subprocess.CompletedProcess:
  # Without the test session's device flags: __main__ must set up the CPU devices itself. The
  # platform stays the CPU, as on a machine without accelerators (on one with a GPU the demo
  # trains on the GPU, its documented choice).
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "spmd", "demo", *SHORT, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def test_python_m_spmd_demo() -> None:
  proc = _demo()
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert "OK: 12 partitioned training steps on 8 cpu devices {'data': 2, 'model': 4} (2d)" in (
      proc.stdout)


def test_python_m_spmd_demo_options() -> None:
  proc = _demo("--cpu-devices", "4", "--mesh", "data=4,model=1", "--strategy", "fsdp")
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert "spmd plan for step on mesh (data=4, model=1)" in proc.stdout
  assert "OK: 12 partitioned training steps on 4 cpu devices {'data': 4, 'model': 1} (fsdp)" in (
      proc.stdout)


def test_bad_mesh_option_is_a_usage_error() -> None:
  proc = _demo("--mesh", "data:2")
  assert proc.returncode == 2 and "expected axis=size pairs like data=2,model=4" in proc.stderr
