"""The wheel installs everything under the mlxspec namespace and its console script runs."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_only_mlxspec_and_runs(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",  # this environment's setuptools: no download, no new venv
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = (tmp_path / "dist").glob("mlxspec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"mlxspec"}, top_level
    assert any(n.startswith("mlxspec/cli/") and n.endswith("main.py") for n in names)
    assert {"mlxspec/recipes/draft_pairs.json", "mlxspec/recipes/quantization/embed8.json"} <= set(
        names)
    assert "mlxspec/metal/__init__.py" in names
    # Every module of the source tree is in the wheel (a subpackage missing from pyproject's
    # list would import from this checkout but not from an installed wheel).
    for folder, package in (("mlxspec", "mlxspec"), ("cli", "mlxspec/cli"), ("metal", "mlxspec/metal")):
        for source in (ROOT / folder).rglob("*.py"):
            assert f"{package}/{source.relative_to(ROOT / folder).as_posix()}" in names, source
    # and every C/C++ source and header the CPU backend compiles on first use (their text is
    # also the build key: a missing header fails the build).
    for source in (ROOT / "mlxspec" / "cpu").glob("_*.[ch]*"):
        assert f"mlxspec/cpu/{source.name}" in names, source

    # A fresh venv with the wheel; its dependencies come from this environment's site-packages
    # through a .pth file (no network, and not this checkout: the .pth adds only a path).
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)  # this environment's pip installs into it (--python)
    py = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
         "--no-index", str(wheel)],
        check=True,
    )
    where = subprocess.run(
        [str(py), "-c", "import mlxspec; print(mlxspec.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout
    assert where.startswith(str(env_dir)), where
    # Generation's modules import from the installed wheel alone (no model needed).
    subprocess.run([str(py), "-c", "import mlxspec.generate, mlxspec.serving.engine, mlxspec.speculative"],
                   check=True, cwd=tmp_path, capture_output=True)
    for args in (["--version"], ["--help"]):
        result = subprocess.run(
            [str(env_dir / "bin" / "mlxspec"), *args], capture_output=True, text=True, cwd=tmp_path
        )
        assert result.returncode == 0, result.stderr
        if args == ["--version"]:
            from mlxspec import __version__

            assert result.stdout.strip() == f"mlxspec, version {__version__}"
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert f"Version: {__version__}" in zipfile.ZipFile(wheel).read(metadata).decode()
