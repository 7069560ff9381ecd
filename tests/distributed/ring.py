"""Two ranks of an ``mx.distributed`` ring group on loopback (127.0.0.1), started the way
``mlx.launch --backend ring -n 2`` starts them (a hostfile and ``MLX_RANK``), but by the test
itself, so it holds each rank's process: to read rank 0's output, kill a rank, and never leave
one running."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

MLXSPEC = shutil.which("mlxspec") or str(Path(sys.executable).with_name("mlxspec"))


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports nobody listens on now."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "PYTEST_"))}
    env.update({"OPENBLAS_NUM_THREADS": "1", "MLXSPEC_SHARD_TIMEOUT": "60", **extra})
    return env


@contextlib.contextmanager
def ring(args: list[str], tmp_path: Path, ranks: int = 2, stdin: bool = False,
         program: tuple[str, ...] = (MLXSPEC,),
         **extra_env: str) -> Iterator[list[subprocess.Popen]]:
    """``mlxspec *args`` (or ``*program, *args``) on ``ranks`` ring processes; every one is
    killed when the block ends. ``stdin``: each rank reads a pipe (``communicate(input)``;
    ``mlx.launch`` gives every rank the same input), else nothing."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(ranks)]))
    procs = []
    try:
        for rank in range(ranks):
            env = environment(MLX_HOSTFILE=str(hostfile), MLX_RANK=str(rank), **extra_env)
            procs.append(subprocess.Popen(
                [*program, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, text=True,
                start_new_session=True))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def one_process(args: list[str], timeout: float = 120,
                input: str | None = None) -> subprocess.CompletedProcess:
    """``mlxspec *args`` as one ordinary process (the reference), reading ``input``."""
    return subprocess.run([MLXSPEC, *args], env=environment(), capture_output=True, text=True,
                          timeout=timeout, input=input)


def json_of(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{"):])
