"""Stable-Baselines3's own test suite with rlinfluence's adapter plugged into every PPO.

Given a checkout of SB3's tests (not vendored here; e.g. the sdist of the installed version,
``pip download --no-deps --no-binary :all: stable-baselines3==2.9.2``, unpacked), runs them with
pytest once per mode, each in its own process, this file loaded as a pytest plugin:

- ``plain``: SB3 unchanged (the baseline);
- ``buffer``: every PPO built with ``rollout_buffer_class=FilteredRolloutBuffer`` when it would
  get SB3's plain ``RolloutBuffer`` (not for Dict observations, which need ``DictRolloutBuffer``);
- ``callback``: ``buffer`` plus ``InfluenceFilterCallback(drop_pct=--drop-pct)`` appended to the
  callbacks of every ``PPO.learn`` of such a model (as a user would plug it in);
- ``rundir``: ``RunDirectoryCallback`` (no evaluation episodes) appended to every ``PPO.learn``;
  where it refuses the model (a ``UserError``, asked with ``config_of`` before ``learn``), the test
  learns without it. Each learn() is a line of ``<out>/rundir_learns.jsonl``: written (a round or
  more on disk), not written, stopped (the writer refused a round later), or refused with the first
  line of the reason;
  the driver prints ``sb3_suite_rundir_written: k/n`` and the refusals by reason.

Only ``stable_baselines3.PPO`` is patched (``_setup_model`` and ``learn``); A2C, DQN, SAC, ... run
as in ``plain``. Prints per mode ``sb3_suite_<mode>: <passed>/<failed>`` (failed = failed +
errors), the skipped count, and the tests whose outcome differs from ``plain`` when it ran.

    python benchmarks/integration/sb3_suite.py --sb3-tests /tmp/sb3/stable_baselines3-2.9.2 --modes plain,buffer,callback
    python benchmarks/integration/sb3_suite.py --sb3-tests DIR tests/test_identity.py tests/test_gae.py   # a subset
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

MODES = ("plain", "buffer", "callback", "rundir")
MODE_ENV, DROP_ENV = "RLINFLUENCE_SB3_SUITE_MODE", "RLINFLUENCE_SB3_SUITE_DROP_PCT"
LEARNS_ENV = "RLINFLUENCE_SB3_SUITE_LEARNS"


# -- the pytest plugin (loaded with ``-p sb3_suite`` in the child process) -------------------------
def pytest_configure(config: Any) -> None:
    """Patch ``stable_baselines3.PPO`` for the mode in ``$RLINFLUENCE_SB3_SUITE_MODE``."""
    mode = os.environ.get(MODE_ENV, "plain")
    if mode == "plain":
        return
    if mode == "rundir":
        _patch_rundir(Path(os.environ[LEARNS_ENV]))
        return
    from gymnasium import spaces
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback, CallbackList

    from rlinfluence.integrations.sb3 import FilteredRolloutBuffer, InfluenceFilterCallback

    setup_model, learn = PPO._setup_model, PPO.learn
    drop_pct = float(os.environ.get(DROP_ENV, "12.5"))

    def patched_setup_model(self: PPO) -> None:
        if self.rollout_buffer_class is None and not isinstance(self.observation_space, spaces.Dict):
            self.rollout_buffer_class = FilteredRolloutBuffer
        setup_model(self)

    def patched_learn(self: PPO, total_timesteps: int, callback: Any = None, *args: Any, **kwargs: Any) -> PPO:
        if mode == "callback" and isinstance(self.rollout_buffer, FilteredRolloutBuffer):
            iif = InfluenceFilterCallback(drop_pct=drop_pct)
            if isinstance(callback, list):
                callback = CallbackList(callback)
            if callback is not None and not isinstance(callback, BaseCallback):  # a plain function
                raise TypeError(f"unexpected callback {callback!r}")
            callback = iif if callback is None else CallbackList([callback, iif])
        return learn(self, total_timesteps, callback, *args, **kwargs)

    PPO._setup_model, PPO.learn = patched_setup_model, patched_learn


def _patch_rundir(learns: Path) -> None:
    """``PPO.learn`` with ``RunDirectoryCallback`` appended; each call's outcome a line of ``learns``."""
    import json
    import tempfile

    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback, CallbackList, ConvertCallback

    from rlinfluence.errors import UserError
    from rlinfluence.integrations.sb3_rundir import RunDirectoryCallback, config_of

    learn = PPO.learn

    def patched_learn(self: PPO, total_timesteps: int, callback: Any = None, *args: Any, **kwargs: Any) -> PPO:
        folder = Path(tempfile.mkdtemp(prefix="sb3_rundir_")) / "run"
        writer = RunDirectoryCallback(folder, eval_episodes=0)
        given = CallbackList(callback) if isinstance(callback, list) else callback
        if given is not None and not isinstance(given, BaseCallback):  # a plain function, as SB3 takes it
            given = ConvertCallback(given)
        try:  # what the callback refuses at the start of learn(), asked before it: the test learns once
            config_of(self, total_timesteps, 0)
            out = learn(self, total_timesteps, writer if given is None else CallbackList([given, writer]), *args, **kwargs)
            rounds = len(list((folder / "buffers").glob("round_*.safetensors")))
            outcome = "written" if rounds else "not written"
            if writer.stopped is not None:
                outcome = f"stopped after {rounds} round(s): {writer.stopped.splitlines()[0]}"
        except UserError as exc:
            outcome = f"refused: {str(exc).splitlines()[0]}"
            out = learn(self, total_timesteps, callback, *args, **kwargs)
        with open(learns, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "outcome": outcome}) + "\n")
        return out

    PPO.learn = patched_learn


# -- the driver ---------------------------------------------------------------------------------------
def outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed / failed / error / skipped, from a junit xml report."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = [child.tag for child in case]
        result[name] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
        result[name] = {"failure": "failed"}.get(result[name], result[name])
    return result


def run_mode(mode: str, args: argparse.Namespace, out: Path) -> tuple[dict[str, str], float]:
    junit = out / f"{mode}.xml"
    env = {**os.environ, MODE_ENV: mode, DROP_ENV: str(args.drop_pct), LEARNS_ENV: str(out / f"{mode}_learns.jsonl"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pytest", "-p", "sb3_suite", "-q", "-p", "no:cacheprovider",
               f"--junitxml={junit}", *args.pytest_args, *(args.files or ["tests"])]
    start = time.perf_counter()
    with open(out / f"{mode}.log", "w") as log:
        subprocess.run(command, cwd=args.sb3_tests, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    return outcomes(junit), time.perf_counter() - start


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--sb3-tests", required=True, type=Path, help="folder holding SB3's tests/ (an SB3 checkout or sdist)")
    parser.add_argument("--modes", default="buffer,callback", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--drop-pct", type=float, default=12.5)
    parser.add_argument("--out", type=Path, default=Path("bench_out/sb3_suite"))
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, one string (e.g. '-k ppo -x')")
    parser.add_argument("files", nargs="*", help="test files or ids relative to --sb3-tests (default: tests)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if not (args.sb3_tests / "tests").is_dir():
        print(f"error: {args.sb3_tests} has no tests/ folder (pass a checkout or unpacked sdist of SB3)", file=sys.stderr)
        sys.exit(2)
    if any(m not in MODES for m in modes):
        print(f"error: --modes must be a comma-separated list of {', '.join(MODES)}, got {args.modes!r}", file=sys.stderr)
        sys.exit(2)
    args.sb3_tests = args.sb3_tests.resolve()
    args.pytest_args = args.pytest_args.split()
    args.out.mkdir(parents=True, exist_ok=True)
    args.out = args.out.resolve()
    results = {}
    for mode in modes:
        results[mode], seconds = run_mode(mode, args, args.out)
        counts = {k: sum(v == k for v in results[mode].values()) for k in ("passed", "failed", "error", "skipped")}
        print(f"sb3_suite_{mode}: {counts['passed']}/{counts['failed'] + counts['error']}  "
              f"(skipped {counts['skipped']}, {seconds:.0f} s, log {args.out / (mode + '.log')})", flush=True)
    if "rundir" in results and (args.out / "rundir_learns.jsonl").is_file():
        import json
        from collections import Counter

        learns = [json.loads(line) for line in (args.out / "rundir_learns.jsonl").read_text().splitlines()]
        written = sum(r["outcome"] == "written" for r in learns)
        print(f"sb3_suite_rundir_written: {written}/{len(learns)}")
        reasons = Counter(re.sub(r"\d+(\.\d+)?", "N", r["outcome"])[:110] for r in learns if r["outcome"] != "written")
        for reason, n in reasons.most_common():
            print(f"  {n} {reason}")
    if "plain" in results:
        for mode in (m for m in modes if m != "plain"):
            for test, outcome in sorted(results[mode].items()):
                base = results["plain"].get(test)
                if outcome != base:
                    print(f"  {mode} differs: {test}: {base} -> {outcome}")
    for mode in modes:
        failed = sorted(t for t, o in results[mode].items() if o in ("failed", "error"))
        if failed:
            print(f"  {mode} failed: " + ", ".join(re.sub(r"^tests\.", "", t) for t in failed))


if __name__ == "__main__":
    main()
