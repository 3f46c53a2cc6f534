"""What every benchmark shares: its command line and its summary lines.

The benchmarks live in one folder per question they answer (``FOLDERS``: speed, attribution,
learning, faults, lm, integration); docs/benchmarks.md lists each with its question and command.
A benchmark is a script, run as ``python benchmarks/<folder>/<name>.py``; it starts with

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
    import harness

which puts every folder on the import path (a script may use another's helpers wherever it lives),
and then takes its arguments from ``harness.parser(__doc__)`` (the first docstring line as the
description, the whole docstring under ``--help``: its command and the figures it ends with) and
prints its figures with ``harness.summary``: one ``name: value`` line per figure, what docs/data
keeps and ``publish_results.py --check`` checks quoted figures against.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent
"""benchmarks/"""
FOLDERS = ("speed", "attribution", "learning", "faults", "lm", "integration")
"""The questions: how fast and what it costs; do the scores predict; does filtering help learning;
which worker is broken and why a run got worse; language models; other trainers and installs."""
STUDIES = ROOT / "studies"
"""The tuning studies whose chosen learning rates the benchmarks train with."""
REPOSITORY = ROOT.parent

for _folder in FOLDERS:
    if str(ROOT / _folder) not in sys.path:
        sys.path.append(str(ROOT / _folder))


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's argument parser: ``--help`` shows its docstring as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def summary(figures: Mapping[str, object] | Iterable[str]) -> None:
    """Print a benchmark's summary: ``name: value`` lines, from a mapping or as lines already
    written; a line that is not ``name: value`` is a bug in the benchmark (ValueError)."""
    lines = [f"{name}: {value}" for name, value in figures.items()] if isinstance(figures, Mapping) else list(figures)
    for line in lines:
        name, sep, value = line.partition(": ")
        if not sep or not name.strip() or "\n" in line:
            raise ValueError(f"not a `name: value` summary line: {line!r}")
    print("\n".join(lines), flush=True)
