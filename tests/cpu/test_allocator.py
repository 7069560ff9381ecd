"""mlxspec.cpu.allocator: the mlxspec command re-executes itself once on mimalloc (Linux).

The independent check that mimalloc serves ``malloc`` is the dynamic linker's own answer: the
address ``malloc`` resolves to in the re-executed process, looked up in ``/proc/self/maps``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxspec.cpu import allocator

MLXSPEC = str(Path(sys.executable).parent / "mlxspec")
LIBRARY = allocator.library_path()
needs_mimalloc = pytest.mark.skipif(
    LIBRARY is None, reason="mimalloc is only used on Linux with the cmeel-mimalloc wheel")

# Runs as `python -c PROBE`: re-executes itself exactly as the console script does, then reports
# where malloc comes from and the environment it was left with.
PROBE = """
import ctypes, json, os
from mlxspec.cpu import allocator
allocator.reexec_on_mimalloc()
address = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value
library = None
for line in open("/proc/self/maps"):
    fields = line.split()
    low, high = (int(x, 16) for x in fields[0].split("-"))
    if low <= address < high and len(fields) > 5:
        library = os.path.basename(fields[5])
print(json.dumps({"malloc_from": library, "ld_preload": os.environ.get("LD_PRELOAD"),
                  "marker": os.environ.get(allocator.USER_PRELOAD), "in_use": allocator.in_use()}))
"""


def environment(**env: str) -> dict[str, str]:
    """This process's environment without any allocator setting of its own, plus ``env``."""
    return {**{k: v for k, v in os.environ.items()
               if k not in ("LD_PRELOAD", allocator.SWITCH, allocator.USER_PRELOAD)}, **env}


def probe(**env: str) -> dict:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                            env=environment(**env), timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@needs_mimalloc
def test_the_command_reexecutes_on_mimalloc_and_puts_ld_preload_back():
    # The user's own preload (a harmless library) must stay preloaded and be what children see.
    out = probe(LD_PRELOAD="libz.so.1")
    assert out["malloc_from"].startswith("libmimalloc"), out
    assert out["in_use"] is True
    assert out["ld_preload"] == "libz.so.1" and out["marker"] is None, out
    out = probe()
    assert out["malloc_from"].startswith("libmimalloc") and out["ld_preload"] is None, out


@needs_mimalloc
def test_the_switch_keeps_glibc():
    out = probe(**{allocator.SWITCH: "0"})
    assert out["malloc_from"].startswith("libc"), out
    assert out["in_use"] is False


@needs_mimalloc
@pytest.mark.parametrize("launch", ["console-script", "python-m"])
def test_the_mlxspec_command_reports_mimalloc(launch):
    """The command as users start it runs on mimalloc (the re-execution in mlxspec/__init__.py);
    calling its main() from another program replaces nothing."""
    command = {"console-script": [MLXSPEC],
               "python-m": [sys.executable, "-m", "mlxspec.cli.main"]}[launch]
    result = subprocess.run([*command, "doctor", "--no-measure", "--json"], capture_output=True,
                            text=True, env=environment(), timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["allocator"].startswith("mimalloc")
    assert result.stderr.count("warning") == 0  # nothing said twice (or at all) on the way


def test_calling_main_from_a_program_does_not_restart_it():
    code = ("import sys\nfrom mlxspec.cli.main import main\n"
            "sys.argv = ['mlxspec', 'doctor', '--no-measure', '--json']\nmain()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=environment(), timeout=120)
    assert result.returncode == 0, result.stderr
    assert not json.loads(result.stdout)["allocator"].startswith("mimalloc")


def test_reexec_environment_runs_once(monkeypatch):
    monkeypatch.setattr(allocator, "in_use", lambda: False)  # as if pytest ran on glibc
    environ = {"LD_PRELOAD": "/opt/user.so", "HOME": "/h"}
    first = allocator.reexec_environment(environ)
    if LIBRARY is None:
        assert first is None
        return
    assert first["LD_PRELOAD"] == f"{LIBRARY}:/opt/user.so"
    assert first[allocator.USER_PRELOAD] == "/opt/user.so" and first["HOME"] == "/h"
    assert environ == {"LD_PRELOAD": "/opt/user.so", "HOME": "/h"}  # the caller's is untouched
    # In the re-executed process: nothing more to do, and the user's LD_PRELOAD is back.
    assert allocator.reexec_environment(first) is None
    assert first["LD_PRELOAD"] == "/opt/user.so" and allocator.USER_PRELOAD not in first
    bare: dict[str, str] = {}
    second = allocator.reexec_environment(bare)
    assert second["LD_PRELOAD"] == str(LIBRARY) and second[allocator.USER_PRELOAD] == ""
    assert allocator.reexec_environment(second) is None and "LD_PRELOAD" not in second
    assert allocator.reexec_environment({allocator.SWITCH: "0"}) is None
    assert allocator.reexec_environment({allocator.SWITCH: " Off "}) is None
    # An allocator the user preloads stays the one that runs.
    assert allocator.reexec_environment({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) is None


@needs_mimalloc
def test_outputs_are_the_same_on_either_allocator(smollm2_dir):
    def generate(switch: str) -> dict:
        result = subprocess.run(
            [MLXSPEC, "generate", "--prompt", "Name three rivers of Europe.", "--max-tokens",
             "24", "--temp", "0", "--json"], capture_output=True, text=True,
            env=environment(**{allocator.SWITCH: switch}), timeout=300)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    on, off = generate("1"), generate("0")
    assert on["generation_tokens"] == off["generation_tokens"] == 24
    assert on["text"] == off["text"]
