"""Write every generated results table of README.md and docs/ from committed result data.

    python benchmarks/publish_results.py --collect bench_out/confirm   # refresh docs/data/ from run folders
    python benchmarks/publish_results.py --collect-detection bench_out/corruption_detection/detection.csv \
        --collect-corruption bench_out/corruption
    python benchmarks/publish_results.py                               # rewrite the tables from docs/data/
    python benchmarks/publish_results.py --check                       # exit 1 if a page's table differs
    python benchmarks/publish_results.py --collect-run bench_out/minigrid40   # one compare folder -> docs/data/<name>.csv

``--collect`` gathers the summary rows of the confirmation folders (``confirm_iif_robust.py``)
into docs/data/confirmation.csv and every run's curve into confirmation_curves.csv (per seed and
round; ``--check`` recomputes the summary rows from it), ``--collect-run`` one compare folder's
into docs/data/<its name>.csv and <its name>_curves.csv (checked the same way), ``--collect-detection`` and ``--collect-corruption`` those of
``corruption_detection.py`` and ``corruption.py``; then every page of TABLES gets its
tables between their markers (``rlinfluence.experiments.published``), and every table of
LEARN_TABLES is rebuilt from its per-seed rows (``hidden_faults.learn_table``); every figure quoted in prose
(``figures.py``: README.md, docs/index.md, each results page's short answer) is checked against its data, and a
disagreement or a number without its source fails. Ends with one line per figure: ``<env>/<method>/<stat>: value``.
"""

from __future__ import annotations

import json
import re
import sys
from functools import partial
from pathlib import Path

import pandas as pd

from rlinfluence.errors import UserError
from rlinfluence.experiments.published import (
    PUBLISHED_COLUMNS,
    collect,
    curves_frame,
    detection_by_round_table,
    detection_table,
    fill,
    flags_table,
    gap_table,
    headline_table,
    read_summary,
    summary_from_curves,
    target_table,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (puts each question's folder on the path)
from explain import slide_lines  # noqa: E402
from figures import check_pages  # noqa: E402
from hidden_faults import (  # noqa: E402
    HELD_OUT_PROTOCOLS,
    held_out_answer,
    learn_table,
    markdown_table,
    prepared,
    summary_lines,
)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data"
ENVS = ("FrozenLake-v1", "Acrobot-v1", "MiniGrid-Empty-8x8-v0", "LunarLander-v3")
# table name -> (its data file, how the table is built from it, the pages that show it)
TABLES = {
    "confirmation": ("confirmation.csv", lambda data: headline_table(data, grids=study_grids()), ("docs/results/tuned-ppo.md",)),
    "detection": ("detection.csv", detection_table, ("docs/results/harmful-records.md",)),
    "detection-rounds": ("detection.csv", detection_by_round_table, ("docs/results/harmful-records.md",)),
    **{f"detection-{c}": ("detection.csv", partial(detection_table, condition=c), ("docs/results/harmful-records.md",))
       for c in ("noise25", "trigger25", "stale25")},
    "corruption": ("corruption.csv", gap_table, ("docs/results/harmful-records.md",)),
    "corruption-targets": ("corruption.csv", target_table, ("docs/results/harmful-records.md",)),
    "audit-flags": ("audit_flags.csv", flags_table, ("docs/results/harmful-records.md",)),
}

# learning tables of hidden_faults.py (``learn_table``): docs/data/<name>.csv -> docs/data/<name>_table.txt
LEARN_TABLES = ("hidden_faults_learn_tuned", "reward_flip_tuned", "corruption_tuned")
HELD_OUT_PAGES = ("docs/results/hidden-faults.md",)
"""The pages whose held-out answer (``hidden_faults.held_out_answer``, between <!-- table:held-out-answer -->
markers) is written from the held-out rows in docs/data; each held-out detection table and summary is rebuilt
from its rows too."""


def study_grids() -> dict[str, list[float]]:
    """Per env, the learning rates its study (benchmarks/studies/<env>.json) tuned over."""
    grids = {}
    for env in ENVS:
        study = json.loads((ROOT / "benchmarks" / "studies" / f"{env}.json").read_text())
        for spec in study.get("tune", []):
            key, _, values = spec.partition("=")
            if key == "learning_rate":
                grids[env] = [float(v) for v in values.split(",")]
    return grids


def held_out(check: bool) -> list[str]:
    """Write (or with ``check`` only compare) each held-out protocol's answer on its pages and its
    detection tables from their per-run rows; the stale ones."""
    return [stale for names, marker in HELD_OUT_PROTOCOLS for stale in held_out_protocol(names, marker, check)]


def held_out_protocol(names: tuple[str, ...], marker: str, check: bool) -> list[str]:
    """``held_out`` for one protocol: its rows ``names`` (native, SB3, Acrobot), its page's ``marker``."""
    stale = []
    frames = [prepared(pd.read_csv(DATA / f"{n}_runs.csv")) if (DATA / f"{n}_runs.csv").is_file() else None
              for n in names]
    if frames[0] is None:
        return stale
    for name, frame in zip(names, frames, strict=True):
        if frame is None:
            continue
        for path, text in ((DATA / f"{name}_table.txt",
                            markdown_table(frame, [c[6:] for c in frame.columns if c.startswith("round_")])),
                           (DATA / f"{name}_summary.txt", "\n".join(summary_lines(frame)) + "\n")):
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
                if not check:
                    path.write_text(text)
    lines = held_out_answer(*frames)
    for page in HELD_OUT_PAGES:
        path = ROOT / page
        old = path.read_text()
        new = fill(old, marker, lines)
        if new != old:
            stale.append(f"{page} ({marker})")
            if not check:
                path.write_text(new)
    return stale


def jobs_table(check: bool) -> list[str]:
    """docs/index.md's table of jobs: README.md's, its links made relative to docs/."""
    table = re.search(r"<!-- table:jobs -->\n(.*?)<!-- /table:jobs -->", (ROOT / "README.md").read_text(), re.S)
    if table is None:
        raise UserError("README.md has no <!-- table:jobs --> ... <!-- /table:jobs --> markers")
    lines = table[1].replace("](docs/", "](").splitlines()
    path = ROOT / "docs" / "index.md"
    old = path.read_text()
    new = fill(old, "jobs", lines)
    if new == old:
        return []
    if not check:
        path.write_text(new)
    return ["docs/index.md (jobs)"]


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--collect", metavar="DIR", help="confirmation folders (one compare folder per env)")
    parser.add_argument("--collect-detection", metavar="CSV", help="corruption_detection.py's detection.csv")
    parser.add_argument("--collect-corruption", metavar="DIR", help="corruption.py's compare folders")
    parser.add_argument("--collect-flags", metavar="CSV", help="audit_flags.py's flags.csv")
    parser.add_argument("--collect-run", metavar="DIR", help="one compare folder: its summary and curves, named after it")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated table is stale")
    args = parser.parse_args()
    DATA.mkdir(parents=True, exist_ok=True)
    if args.collect:
        folders = [Path(args.collect) / env for env in ENVS if (Path(args.collect) / env / "summary.csv").is_file()]
        collect(folders).to_csv(DATA / "confirmation.csv", index=False)
        curves_frame(folders).to_csv(DATA / "confirmation_curves.csv", index=False)
    if args.collect_run:
        folder = Path(args.collect_run)
        collect([folder]).to_csv(DATA / f"{folder.name}.csv", index=False)
        curves_frame([folder]).to_csv(DATA / f"{folder.name}_curves.csv", index=False)
    if args.collect_detection:
        pd.read_csv(args.collect_detection).to_csv(DATA / "detection.csv", index=False)
    if args.collect_flags:
        pd.read_csv(args.collect_flags).to_csv(DATA / "audit_flags.csv", index=False)
    if args.collect_corruption:
        folders = sorted(p.parent for p in Path(args.collect_corruption).glob("*/summary.csv"))
        collect(folders).to_csv(DATA / "corruption.csv", index=False)
    stale = []
    for name, (data_file, build, pages) in TABLES.items():
        if not (DATA / data_file).is_file():
            continue
        data = read_summary(DATA / data_file)
        lines = build(data)
        for page in pages:
            path = ROOT / page
            old = path.read_text()
            new = fill(old, name, lines)
            if new != old:
                stale.append(f"{page} ({name})")
                if not args.check:
                    path.write_text(new)
        if name == "confirmation":
            for row in data.itertuples():
                if row.method != "ppo":
                    print(f"{row.env}/{row.method}/log_ratio80: {row.log_ratio80:.3f} [{row.log_ratio80_lo:.3f}, "
                          f"{row.log_ratio80_hi:.3f}]")
                    print(f"{row.env}/{row.method}/paired_poi_auc: {row.poi_auc:.2f} "
                          f"[{row.poi_auc_lo:.2f}, {row.poi_auc_hi:.2f}]")
                print(f"{row.env}/{row.method}/reached80: {row.reached80_n}/{row.seeds}")
    for name in LEARN_TABLES:  # tables included whole from docs/data, rebuilt from their per-seed rows
        lines, _ = learn_table(pd.read_csv(DATA / f"{name}.csv"))
        path = DATA / f"{name}_table.txt"
        if path.read_text() != "\n".join(lines) + "\n":
            stale.append(str(path.relative_to(ROOT)))
            if not args.check:
                path.write_text("\n".join(lines) + "\n")
    stale += held_out(args.check)
    slides = DATA / "explain_slides_summary.txt"  # explain's held-out slides: the summary lines from the rows
    text = "\n".join(slide_lines(pd.read_csv(DATA / "explain_slides_runs.csv"))) + "\n"
    if slides.read_text() != text:
        stale.append(str(slides.relative_to(ROOT)))
        if not args.check:
            slides.write_text(text)
    for curves in sorted(DATA.glob("*_curves.csv")):  # a published summary beside its per-seed curves
        name = curves.name.removesuffix("_curves.csv")
        if (DATA / f"{name}.csv").is_file() and not summary_matches_curves(name):
            stale.append(f"docs/data/{name}.csv (not what {curves.name} gives: collect both again)")
    stale += jobs_table(args.check)
    figures = check_pages()  # figures quoted in prose: never rewritten, only checked
    for problem in figures:
        print(problem, file=sys.stderr)
    if args.check and stale:
        print(f"stale generated tables in {', '.join(stale)}: run python benchmarks/publish_results.py", file=sys.stderr)
        return 1
    return 1 if figures else 0


def summary_matches_curves(name: str) -> bool:
    """Whether docs/data/<name>.csv's summary figures are what its per-seed curves give
    (``summary_from_curves``: every numeric column, the reading and the failed seeds)."""
    published = read_summary(DATA / f"{name}.csv")
    recomputed = summary_from_curves(pd.read_csv(DATA / f"{name}_curves.csv"))
    keys = ["env", "method"]
    merged = published.merge(recomputed, on=keys, how="outer", suffixes=("", "_recomputed"), indicator=True)
    if (merged["_merge"] != "both").any():
        return False
    for column in PUBLISHED_COLUMNS:
        if column in keys or f"{column}_recomputed" not in merged:
            continue
        a, b = merged[column], merged[f"{column}_recomputed"]
        if column in ("verdict80", "failed_seeds"):
            same = a.fillna("").astype(str) == b.fillna("").astype(str)
        else:
            a, b = pd.to_numeric(a), pd.to_numeric(b)
            same = ((a - b).abs() <= 1e-9 * (1 + b.abs())) | (a.isna() & b.isna())
        if not same.all():
            return False
    return True


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
