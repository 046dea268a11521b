"""The ``python -m spmd demo`` job: in-process, and as a fresh process that sets up its devices."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmd.demo import STEPS, run_demo

ROOT = Path(__file__).resolve().parents[1]


def test_run_demo(capsys: pytest.CaptureFixture[str]) -> None:
  assert run_demo() == 0
  out = capsys.readouterr().out
  assert "spmd plan for train_step on mesh (data=2, model=4)" in out
  assert "all-reduce(model)" in out and "all-reduce(data)" in out
  assert "\nOK: " in out


def test_python_m_spmd_demo() -> None:
  # Without the test session's device flags: __main__ must set up 8 CPU devices itself.
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  proc = subprocess.run([sys.executable, "-m", "spmd", "demo"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert f"OK: {STEPS} partitioned training steps on 8 cpu devices" in proc.stdout


def test_python_m_spmd_demo_cpu_devices_flag() -> None:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  proc = subprocess.run([sys.executable, "-m", "spmd", "demo", "--cpu-devices", "4"], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert "spmd plan for train_step on mesh (data=1, model=4)" in proc.stdout
  assert f"OK: {STEPS} partitioned training steps on 4 cpu devices" in proc.stdout
