"""Packaging: every subpackage is listed, and a built wheel carries the Metal kernel sources."""

import pathlib
import subprocess
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_package():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "mlx_ferrum").rglob("__init__.py")}
    assert found <= listed, f"add to pyproject [tool.setuptools] packages: {sorted(found - listed)}"


def _build_wheel(tmp_path) -> pathlib.Path:
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return next(tmp_path.glob("mlx_ferrum-*.whl"))


def test_wheel_ships_the_runtime_and_kernels_only(tmp_path):
    """The wheel carries the runtime and the .metal sources: no CPU test harness, no kernel
    test cases and no mlx-lm comparison code (those live in tests/support and benchmarks/)."""
    archive = zipfile.ZipFile(_build_wheel(tmp_path))
    names = archive.namelist()
    for k in (REPO / "metal_kernels").glob("*.metal"):
        assert f"mlx_ferrum/metal_kernels/{k.name}" in names
    assert any(n.endswith("entry_points.txt") for n in names)
    for page_file in (REPO / "mlx_ferrum" / "server" / "web").iterdir():  # the chat page of mlx-ferrum serve
        assert f"mlx_ferrum/server/web/{page_file.name}" in names
    shipped = [n for n in names if n.startswith("mlx_ferrum/")]
    assert not [n for n in shipped if "/testing/" in n or "metal_harness" in n or n.endswith((".cpp", ".hpp"))]
    assert not [n for n in shipped if n.startswith(("mlx_ferrum/tests/", "mlx_ferrum/benchmarks/"))]
    for name in shipped:
        if name.endswith(".py"):
            source = archive.read(name).decode()
            assert "import mlx_lm" not in source and "from mlx_lm" not in source, name


@pytest.mark.slow
def test_wheel_installs_into_a_clean_venv_and_generates(tmp_path, stories_path):
    """``pip install`` of the built wheel into a fresh virtual environment (dependencies from
    the package index) runs ``mlx-ferrum generate`` on stories260K, away from the source tree."""
    wheel = _build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([str(venv / "bin" / "mlx-ferrum"), "generate", "--model", str(stories_path), "--prompt",
                        "Once upon a time", "--max-tokens", "20", "--temp", "0"],
                       capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(r.stdout.strip()) > 0
    r = subprocess.run([str(py), "-c", "import mlx_ferrum, sys; sys.exit(0 if 'site-packages' in mlx_ferrum.__file__ else 1)"],
                       cwd=str(tmp_path), timeout=120)
    assert r.returncode == 0
