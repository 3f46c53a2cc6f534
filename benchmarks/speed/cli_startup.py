"""Start-up time of the command line against `import torch`, in one run, side by side.

    python benchmarks/speed/cli_startup.py --repeats 5

Each command runs in a fresh interpreter ``--repeats`` times (the median counts), as does
``python -c "import torch"``. Ends with one line per figure: ``<command>/seconds`` and
``<command>/ratio_to_import_torch``.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

COMMANDS = {"--help": ["-m", "rlinfluence.cli", "--help"], "train --help": ["-m", "rlinfluence.cli", "train", "--help"],
            "--version": ["-m", "rlinfluence.cli", "--version"]}


def seconds(args: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, *args], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch_seconds = seconds(["-c", "import torch"], args.repeats)
    print(f"import torch/seconds: {torch_seconds:.3f}")
    for name, command in COMMANDS.items():
        t = seconds(command, args.repeats)
        print(f"rlinfluence {name}/seconds: {t:.3f}")
        print(f"rlinfluence {name}/ratio_to_import_torch: {t / torch_seconds:.2f}")


if __name__ == "__main__":
    main()
