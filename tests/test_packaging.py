"""The installed import names: the kernels in the repository's top-level ops/ are `lightning_slide.ops`.

A wheel, an editable install and a checkout on PYTHONPATH (how the GPU machine runs it) all give the same
name, and none of them leaves a top-level `ops` behind (a common name that other distributions also use).
"""

import importlib.metadata
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "lightning-slide"
IMPORT_OPS = """
import importlib.util, sys
import lightning_slide.ops
print(lightning_slide.ops.__file__)
print(lightning_slide.ops.norm.__name__, lightning_slide.ops.patch.__module__)
print(sorted(name for name in sys.modules if name == "ops" or name.startswith("ops.")))
print(importlib.util.find_spec("ops") is not None)
"""
# where torch, lightning, ... are; under -S their .pth files are not read, so no install of this package is seen
PACKAGES = [Path(p) for p in site.getsitepackages()]


def _python(code: str, cwd: Path, pythonpath: list[Path], *flags: str) -> list[str]:
    """Run `code` in a child interpreter outside the checkout; its printed lines."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    done = subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's wheel, built from a copy of the sources (the build leaves its scratch folders there)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for folder in ("lightning_slide", "ops"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("*.whl")
    return built


def test_the_wheel_holds_one_top_level_package_lightning_slide(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    (info,) = (top for top in tops if top.endswith(".dist-info"))
    assert tops == {"lightning_slide", info}
    assert zipfile.ZipFile(wheel).read(f"{info}/top_level.txt").decode().split() == ["lightning_slide"]


def test_the_wheel_holds_every_module_of_the_package_with_the_kernels_under_lightning_slide_ops(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / "lightning_slide").rglob("*.py")}
    expected |= {f"lightning_slide/ops/{p.relative_to(ROOT / 'ops').as_posix()}" for p in (ROOT / "ops").rglob("*.py")}
    assert expected <= names


@pytest.mark.slow
def test_an_installed_wheel_imports_the_kernels_as_lightning_slide_ops(wheel, tmp_path):
    target = tmp_path / "site-packages"
    zipfile.ZipFile(wheel).extractall(target)  # what pip puts into site-packages for a pure-Python wheel
    file, names, loaded, findable = _python(IMPORT_OPS, tmp_path, [target, *PACKAGES], "-S")
    assert Path(file) == target / "lightning_slide" / "ops" / "__init__.py"
    assert names == "lightning_slide.ops.norm lightning_slide.ops.hf_patch"
    assert (loaded, findable) == ("[]", "False")


@pytest.mark.slow
def test_a_checkout_on_pythonpath_imports_the_kernels_as_lightning_slide_ops(tmp_path):
    file, names, loaded, _ = _python(IMPORT_OPS, tmp_path, [ROOT, *PACKAGES], "-S")
    assert Path(file) == ROOT / "ops" / "__init__.py"
    assert names == "lightning_slide.ops.norm lightning_slide.ops.hf_patch"
    assert loaded == "[]"  # the kernels import one another relatively: no second copy under the bare name


@pytest.mark.slow
def test_the_installed_package_imports_the_kernels_as_lightning_slide_ops_and_no_top_level_ops(tmp_path):
    """Whatever install this environment has (an editable one where the README's command made it)."""
    file, names, loaded, findable = _python(IMPORT_OPS, tmp_path, [])
    assert Path(file).parts[-2:] == ("ops", "__init__.py")
    assert names == "lightning_slide.ops.norm lightning_slide.ops.hf_patch"
    assert (loaded, findable) == ("[]", "False")


def test_the_installed_distribution_declares_only_lightning_slide_as_top_level():
    top_level = importlib.metadata.distribution(DISTRIBUTION).read_text("top_level.txt")
    assert top_level is not None and top_level.split() == ["lightning_slide"]
