"""mlxspec.cpu.build: the first use of one extension compiles every missing one side by side, and
a failure is its own extension's alone (a stand-in compiler that logs, waits and writes).
The real builds are exercised by every test that loads the CPU ops or the packed kernel."""

from __future__ import annotations

import sys
import time
import types

import pytest

from mlxspec.cpu import build

COMPILER = """#!/bin/sh
out=""; src=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out="$2"; shift ;;
    *nb_combined.cpp) ;;
    *.cpp) src="$1" ;;
  esac
  shift
done
name=$(basename "$src")
echo "start $name" >> "{log}"
sleep 1
case "$name" in
  broken*) echo "$src:3:1: error: expected ';' before '}}'" >&2; exit 1 ;;
  hung*) (sleep 2; echo late > "$out.late") & sleep 60 ;;
esac
echo "module $name" > "$out"
echo "end $name" >> "{log}"
"""


@pytest.fixture
def extensions(tmp_path, monkeypatch):
    """Three stand-in extensions (``ok``, ``other`` and ``broken``; ``off`` unwanted) in
    ``MODULES``, built by the stand-in compiler into a fresh ``MLXSPEC_HOME``."""
    monkeypatch.setenv("MLXSPEC_HOME", str(tmp_path / "home"))
    log = tmp_path / "compiler.log"
    compiler = tmp_path / "fake-g++"
    compiler.write_text(COMPILER.format(log=log))
    compiler.chmod(0o755)
    monkeypatch.setattr(build, "compiler", lambda: [str(compiler)])
    found = {}
    for name in ("ok", "other", "broken", "off", "hung"):
        source = tmp_path / f"{name}.cpp"
        source.write_text(f"// {name}\n")
        module = types.ModuleType(f"fake_{name}")
        module.EXTENSION = build.Extension(source, f"_fake_{name}",
                                           wanted=lambda n=name: n not in ("off", "hung"))
        monkeypatch.setitem(sys.modules, module.__name__, module)
        found[name] = module.EXTENSION
    monkeypatch.setattr(build, "MODULES", tuple(f"fake_{n}" for n in found))
    return found, log


def built(extension) -> bool:
    return build._plan(extension)[0].is_file()


def test_one_first_use_builds_every_wanted_extension_at_once(extensions):
    found, log = extensions
    path = build.library(found["ok"])
    assert path.read_text() == "module ok.cpp\n" and path.name.startswith("_fake_ok")
    assert built(found["other"]) and not built(found["off"])
    events = log.read_text().split("\n")
    # side by side: every compiler had started before the first one finished
    first_end = min(i for i, line in enumerate(events) if line.startswith("end"))
    assert {line for line in events[:first_end] if line.startswith("start")} == {
        "start ok.cpp", "start other.cpp", "start broken.cpp"}
    assert build.library(found["other"]) == build._plan(found["other"])[0]  # built: no new run
    assert log.read_text().count("start") == 3


def test_a_failing_companion_is_reported_by_its_own_first_use_only(extensions):
    found, _ = extensions
    assert build.library(found["other"]).is_file()  # its companion "broken" failed silently
    with pytest.raises(build.Unavailable, match=r"compiling broken\.cpp failed: .*error: expected"):
        build.library(found["broken"])
    home = build._plan(found["ok"])[0].parents[2]
    assert not list(home.rglob("tmp*"))  # a failed build leaves no half-written module

def test_the_extension_asked_for_fails_with_one_line_when_its_build_fails(extensions):
    found, _ = extensions
    with pytest.raises(build.Unavailable) as failure:
        build.library(found["broken"])
    assert "\n" not in str(failure.value)
    assert built(found["ok"]) and built(found["other"])  # the others were built all the same


def test_a_build_past_its_time_is_killed_with_its_stages_and_leaves_nothing(extensions,
                                                                          monkeypatch):
    found, _ = extensions
    monkeypatch.setattr(build, "BUILD_TIMEOUT_S", 1)
    start = time.monotonic()
    with pytest.raises(build.Unavailable, match=r"compiling hung\.cpp failed: timed out"):
        build.library(found["hung"])
    assert time.monotonic() - start < 30  # not the stand-in compiler's 60 s
    home = build._plan(found["hung"])[0].parents[2]
    time.sleep(3)  # a stage left running would write its file 2 s after it started
    assert not list(home.rglob("tmp*")), list(home.rglob("*"))
