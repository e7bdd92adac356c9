"""The package's layers point down only: config; cost model and plan; planner and simulator; runtime;
control; train, service and cli. The contracts live in pyproject.toml ([tool.importlinter])."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                           "sys.argv = ['lint-imports', '--no-cache']; lint_imports_command()"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_import_contracts_hold():
    out = lint_imports(REPO)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    """The contract can fail: the same package with config importing the planner is refused."""
    shutil.copytree(REPO / "malleus_svc", tmp_path / "malleus_svc", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "malleus_svc" / "config" / "errors.py", "a") as f:
        f.write("\nfrom malleus_svc.planner import plan as _upward  # noqa: E402\n")
    out = lint_imports(tmp_path)
    assert out.returncode != 0
    assert "malleus_svc.config.errors -> malleus_svc.planner" in out.stdout


def test_every_module_imports_on_its_own():
    """No cycle leaves a module half-initialised: each imports first in a clean package namespace
    (third-party modules stay loaded, so this costs one interpreter)."""
    script = textwrap.dedent("""
        import importlib, pkgutil, sys, traceback
        import malleus_svc
        names = sorted(m.name for m in pkgutil.walk_packages(malleus_svc.__path__, "malleus_svc."))
        failed = []
        for name in names:
            for loaded in [k for k in sys.modules if k == "malleus_svc" or k.startswith("malleus_svc.")]:
                del sys.modules[loaded]
            try:
                importlib.import_module(name)
            except Exception:
                failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
        print(len(names), "modules")
        print("\\n".join(failed))
        sys.exit(1 if failed else 0)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert int(out.stdout.split()[0]) > 50


def test_the_command_line_loads_neither_ray_nor_torch_until_a_command_needs_them():
    """`malleus plan` and the other planning commands start without Ray or torch (process start is
    part of a plan's time); the commands that talk to a job import them themselves."""
    code = ("import sys, malleus_svc.cli as c; c.build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "[]"
