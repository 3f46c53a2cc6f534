"""Confirmation of iif-robust against tuned PPO on seeds and evaluation episodes no choice saw.

    python benchmarks/learning/confirm_iif_robust.py --first-seed 101 --seeds 10 --out bench_out/confirm

Each env reruns the choices of its study in ``benchmarks/studies/<env>.json`` (every method's
learning rate, tuned on the study's tuning seeds; the study's evaluation seeds 1-5 are where
iif-robust was picked among ~8 variants) with ``rlinfluence compare --confirm``: no tuning, new
training seeds, and evaluation episodes derived from those seeds, so no run of the confirmation
shares a seed or an evaluation episode with any choice. Re-running resumes. Ends with one line per
figure, ``<env>/<method>/<statistic>: value`` (see ``comparison.summary_lines``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: idle BLAS threads spin on 2 cores
os.environ.setdefault("OMP_NUM_THREADS", "1")


import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from rlinfluence.errors import UserError  # noqa: E402
from rlinfluence.experiments import CompareConfig, compare  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

STUDIES = harness.STUDIES
ENVS = "FrozenLake-v1,Acrobot-v1,MiniGrid-Empty-8x8-v0,LunarLander-v3"


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--envs", default=ENVS)
    parser.add_argument("--first-seed", type=int, default=101)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="bench_out/confirm")
    args = parser.parse_args()
    for env in args.envs.split(","):
        print(f"== {env}: confirming {STUDIES / (env + '.json')} on seeds {args.first_seed}.."
              f"{args.first_seed + args.seeds - 1}", flush=True)
        compare(CompareConfig(confirm=str(STUDIES / f"{env}.json"), first_seed=args.first_seed, seeds=args.seeds,
                              out=str(Path(args.out) / env), workers=args.workers, clock="cpu", progress=False))
        print(f"== {env}: done", flush=True)


if __name__ == "__main__":
    try:
        main()
    except UserError as exc:  # bad input: one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
