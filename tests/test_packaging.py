"""Packaging: every subpackage is listed, and a built wheel carries the Metal kernel sources."""

import pathlib
import subprocess
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
import zipfile

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_package():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "mlx_ferrum").rglob("__init__.py")}
    assert found <= listed, f"add to pyproject [tool.setuptools] packages: {sorted(found - listed)}"


def test_wheel_contains_kernels_and_harness(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next(tmp_path.glob("mlx_ferrum-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for k in (REPO / "metal_kernels").glob("*.metal"):
        assert f"mlx_ferrum/metal_kernels/{k.name}" in names
    assert "mlx_ferrum/testing/metal_harness/msl_compat.h" in names
    assert any(n.endswith("entry_points.txt") for n in names)
