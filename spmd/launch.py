"""``python -m spmd launch -n N script.py ...``: N local processes of one JAX program.

Each process joins the run through ``jax.distributed.initialize`` (a coordinator on a free port
of 127.0.0.1, gloo collectives across processes, ``cpu_devices`` simulated CPU devices each)
before the script runs as ``__main__``, so a script written for one process sees every process's
devices in ``jax.devices()`` and runs unchanged. Their output is streamed with a ``[pK]`` prefix;
the first process that fails ends the run with its exit code, and every process still running is
stopped on exit, timeout or Ctrl-C.
"""
from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from typing import IO, Iterator, Sequence

ENV = "SPMD_LAUNCH"    # a child's Process, as JSON
TIMEOUT_EXIT = 124     # as coreutils' timeout


@dataclass(frozen=True)
class Process:
  """What one child needs to join the run."""

  coordinator: str
  num_processes: int
  process_id: int
  cpu_devices: int


def launch(script: str, args: Sequence[str], num_processes: int, cpu_devices: int = 1,
           timeout: float | None = None) -> int:
  """Runs ``script args...`` in ``num_processes`` processes; returns 0 if all succeed, else the
  exit code of the first that failed (``TIMEOUT_EXIT`` after ``timeout`` seconds)."""
  if num_processes < 1 or cpu_devices < 1:
    raise ValueError(f"spmd launch: needs at least one process and one CPU device each, got "
                     f"-n {num_processes} --cpu-devices {cpu_devices}")
  coordinator = f"127.0.0.1:{_free_port()}"
  procs: list[subprocess.Popen] = []
  pumps: list[threading.Thread] = []
  with _exit_on_sigterm():
    try:
      for k in range(num_processes):
        procs.append(_start(Process(coordinator, num_processes, k, cpu_devices), script, args))
        pumps.append(threading.Thread(target=_pump, args=(procs[-1].stdout, f"[p{k}] ".encode()),
                                      daemon=True))
        pumps[-1].start()
      return _wait(procs, timeout)
    except KeyboardInterrupt:
      return 128 + signal.SIGINT
    finally:
      _stop(procs)
      for t in pumps:
        t.join()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(proc: Process, script: str, args: Sequence[str]) -> subprocess.Popen:
  env = dict(os.environ, PYTHONUNBUFFERED="1", **{ENV: json.dumps(asdict(proc))})
  return subprocess.Popen([sys.executable, "-m", "spmd.launch", script, *args], env=env,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)


def _pump(stream: IO[bytes], prefix: bytes) -> None:
  """Copies a child's output to ours, line by line, each line prefixed."""
  out = sys.stdout.buffer
  for line in iter(stream.readline, b""):
    out.write(prefix + line)
    out.flush()
  stream.close()


def _wait(procs: list[subprocess.Popen], timeout: float | None) -> int:
  deadline = None if timeout is None else time.monotonic() + timeout
  while True:
    codes = [p.poll() for p in procs]
    failed = [c for c in codes if c not in (None, 0)]
    if failed:
      return failed[0] if failed[0] > 0 else 128 - failed[0]  # -N: killed by signal N
    if all(c == 0 for c in codes):
      return 0
    if deadline is not None and time.monotonic() > deadline:
      print(f"spmd launch: timed out after {timeout} s", file=sys.stderr)
      return TIMEOUT_EXIT
    time.sleep(0.05)


def _stop(procs: list[subprocess.Popen]) -> None:
  """Kills the processes still running: JAX takes SIGTERM for a preemption notice, and a
  process whose peer failed is blocked in a collective that would never return."""
  for p in procs:
    if p.poll() is None:
      p.kill()
  for p in procs:
    p.wait()


@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
  """Within it, a SIGTERM to the launcher exits through ``finally`` (stopping the children), on
  the main thread, the only one where handlers can be set."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _bootstrap(argv: list[str]) -> None:
  """In a child: join the run, then run the script as ``__main__``."""
  proc = Process(**json.loads(os.environ.pop(ENV)))
  import jax
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", proc.cpu_devices)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(proc.coordinator, proc.num_processes, proc.process_id)
  sys.argv = argv
  sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
  code = _run(argv[0])
  if code:  # at once: JAX's exit handler would wait for the others, which wait for this one
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(script: str) -> int:
  """Runs ``script`` as ``__main__``; returns its exit code (1 for an uncaught exception)."""
  try:
    runpy.run_path(script, run_name="__main__")
  except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
      return e.code or 0
    print(e.code, file=sys.stderr)
    return 1
  except BaseException:  # noqa: BLE001 (KeyboardInterrupt included: it fails the run)
    traceback.print_exc()
    return 1
  return 0


if __name__ == "__main__":
  _bootstrap(sys.argv[1:])
