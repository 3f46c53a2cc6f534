"""The documentation builds (``mkdocs build --strict``), the package ships ``py.typed``, and the
guide's custom-filter example (examples/custom_filter.py) still works."""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS_PACKAGES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


def _missing_docs_packages() -> list[str]:
    missing = []
    for name in DOCS_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            missing.append(name)
    return missing


@pytest.mark.skipif(bool(_missing_docs_packages()), reason="docs extra not installed: pip install -e '.[docs]'")
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    # the guide, the existing pages (with their figures) and the API reference are all there
    for page in ("index.html", "guide/filters/index.html", "guide/resume/index.html", "results/tuned-ppo/index.html",
                 "api/influence/index.html", "api/ppo/index.html", "figures/paper-protocol-frozenlake.png"):
        assert (site / page).is_file(), page
    api = (site / "api/influence/index.html").read_text()
    assert 'id="rlinfluence.influence.tracin_influence"' in api
    # the example is included in the filter guide from its file, not copied
    assert "DropHarmfulEpisodes" in (site / "guide/filters/index.html").read_text()


def test_py_typed_shipped() -> None:
    assert (importlib.resources.files("rlinfluence") / "py.typed").is_file()
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["rlinfluence"]


def test_py_typed_in_wheel(tmp_path: Path) -> None:
    """A wheel built from the sources (as ``pip install .`` installs it) contains py.typed."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
         "--wheel-dir", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True,
    )
    if result.returncode and "No module named" in result.stderr:
        pytest.skip(f"cannot build a wheel here: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr[-4000:]
    (wheel,) = (tmp_path / "dist").glob("rlinfluence-*.whl")
    assert "rlinfluence/py.typed" in zipfile.ZipFile(wheel).namelist()


def test_custom_filter_example(tmp_path: Path) -> None:
    """The guide's complete example: DropHarmfulEpisodes drops whole episodes and logs its stats."""
    from rlinfluence.ppo import PPO
    from rlinfluence.rundir import RunDirectory
    from tests.conftest import tiny_config

    spec = importlib.util.spec_from_file_location("custom_filter", ROOT / "examples" / "custom_filter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    config = tiny_config(run_root=str(tmp_path), method="harmful-episodes", save_buffers=True)
    trainer = PPO(config, filter=module.DropHarmfulEpisodes(drop_pct=50)).learn()
    metrics = pd.read_csv(trainer.run.path / "metrics.csv")
    assert len(metrics) == 2
    assert (metrics["dropped_episodes"] >= 1).all() and (metrics["kept_fraction"] < 1).all()
    run = RunDirectory.open_existing(trainer.run.path, tensorboard=False)
    for round_index, row in metrics.iterrows():
        if row["minibatch_guard"]:
            continue  # too few records survived: the guard kept the best-scored ones instead
        tensors = run.load_buffer(round_index)
        episodes, keep = tensors["episode_ids"], tensors["keep"]
        for episode in episodes.unique():  # an episode's records are all kept or all dropped
            assert keep[episodes == episode].unique().numel() == 1


def test_the_quickstart_example_runs(tmp_path: Path, monkeypatch) -> None:
    """docs/index.md's Quickstart Python block, run as a user would (in a fresh folder)."""
    text = (Path(__file__).parent.parent / "docs" / "index.md").read_text()
    quickstart = text.split("## Quickstart", 1)[1]
    code = quickstart.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "docs/index.md (Quickstart)", "exec"), namespace)  # noqa: S102 - the docs' own example
    scores = namespace["scores"]
    assert scores.shape == (2048,) and bool((scores < 0).any()) and bool((scores > 0).any())


def test_the_readmes_first_session_runs(tmp_path: Path, monkeypatch, capsys) -> None:
    """README.md's first session, every command as written (in-process), on 2 rounds instead of 8."""
    from rlinfluence.cli import main

    text = (ROOT / "README.md").read_text().split("## A first session", 1)[1]
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    commands = [shlex.split(line.split("#", 1)[0]) for line in block.splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["rlinfluence", "train"], ["rlinfluence", "audit"], ["rlinfluence", "explain"],
                                         ["rlinfluence", "attribute"], ["rlinfluence", "report"]]
    monkeypatch.chdir(tmp_path)
    train = [a if a != "16384" else "4096" for a in commands[0][1:]]
    assert main([*train, "--no-progress"]) == 0
    run = capsys.readouterr().out.split("run directory: ")[1].split()[0]
    for command in commands[1:]:
        args = [run if a == "RUN" else a for a in command[1:]]
        args = [a if a != "3" else "1" for a in args]  # --round 3 of 8 -> round 1 of 2
        assert main(args) == 0, capsys.readouterr().err


PLACEHOLDERS = {"ENV": "CartPole-v1", "S": "1", "K": "1", "N": "1"}
"""Words the docs write for a value of the reader's (a run folder such as RUN stays: parsing never opens it)."""


def test_every_command_the_docs_show_parses_as_written(capsys):
    """Each `rlinfluence ...` line of a shell block in README.md and docs/ (placeholders filled in;
    lines with optional [..] parts, alternatives or shell variables left out) is a command line the
    parser takes: no flag renamed or removed under a guide, no value out of its choices."""
    from rlinfluence import cli

    checked = 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                if not line.startswith("rlinfluence ") or any(c in line for c in "[|<$") or "..." in line:
                    continue
                args = [PLACEHOLDERS.get(a, a) for a in shlex.split(line)[1:]]
                if "--help" in args:
                    continue
                cli._parse(args)  # raises UserError (or exits) on a command line the parser refuses
                checked += 1
    capsys.readouterr()
    assert checked >= 30  # 38 when written: the check found the commands


def test_docs_benchmarks_lists_every_benchmark_script():
    listed = (ROOT / "docs" / "benchmarks.md").read_text()
    scripts = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "benchmarks").glob("*/*.py"))]
    unlisted = [script for script in scripts if f"`{script}`" not in listed]
    assert len(scripts) >= 30
    assert not unlisted, f"add them to docs/benchmarks.md's list, by question: {unlisted}"
