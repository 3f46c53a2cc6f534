"""Write every generated results table of README.md and docs/ from committed result data.

    python benchmarks/publish_results.py --collect bench_out/confirm   # refresh docs/data/ from run folders
    python benchmarks/publish_results.py                               # rewrite the tables from docs/data/
    python benchmarks/publish_results.py --check                       # exit 1 if a page's table differs

``--collect`` gathers the summary rows of the confirmation folders (``confirm_iif_robust.py``)
into docs/data/confirmation.csv; then every page in PAGES gets the table between its markers
(``rlinfluence.experiments.published``). Ends with one line per figure: ``<env>/<method>/<stat>: value``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from rlinfluence.errors import UserError
from rlinfluence.experiments.published import collect, fill, headline_table

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data" / "confirmation.csv"
PAGES = ("README.md", "docs/index.md", "docs/results/tuned-ppo.md")
ENVS = ("FrozenLake-v1", "Acrobot-v1", "MiniGrid-Empty-8x8-v0", "LunarLander-v3")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collect", metavar="DIR", help="folder holding one confirmation compare folder per env")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated table is stale")
    args = parser.parse_args()
    if args.collect:
        folders = [Path(args.collect) / env for env in ENVS if (Path(args.collect) / env / "summary.csv").is_file()]
        DATA.parent.mkdir(parents=True, exist_ok=True)
        collect(folders).to_csv(DATA, index=False)
    data = pd.read_csv(DATA)
    lines = headline_table(data)
    stale = []
    for page in PAGES:
        path = ROOT / page
        old = path.read_text()
        new = fill(old, "confirmation", lines)
        if new != old:
            stale.append(page)
            if not args.check:
                path.write_text(new)
    for row in data.itertuples():
        if row.method != "ppo":
            print(f"{row.env}/{row.method}/log_ratio80: {row.log_ratio80:.3f} [{row.log_ratio80_lo:.3f}, "
                  f"{row.log_ratio80_hi:.3f}]")
            print(f"{row.env}/{row.method}/paired_poi_auc: {row.poi_auc:.2f} [{row.poi_auc_lo:.2f}, {row.poi_auc_hi:.2f}]")
        print(f"{row.env}/{row.method}/reached80: {row.reached80_n}/{row.seeds}")
    if args.check and stale:
        print(f"stale generated tables in {', '.join(stale)}: run python benchmarks/publish_results.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
