"""rlinfluence installed into a user's existing environment: a fresh venv that already holds torch,
Stable-Baselines3, TRL and the newest pandas and numpy, then ``pip install`` of this checkout (no
extras). Checks that pip leaves the user's packages as they were and that ``pip check`` is clean, then runs a short quickstart (``rlinfluence
train`` + ``audit``), trains an SB3 PPO run with ``RunDirectoryCallback`` and runs every analysis
command on it. Downloads from PyPI (not part of CI).

    python benchmarks/integration/install_beside.py --venv /tmp/beside [--torch 2.13.0] [--keep]

``--torch``: the torch the "user" had (any release in the package's range; on this machine only
2.13.0 is a CPU wheel on disk, others download a CUDA build of several GB). Prints each step as
it passes and the summary lines ``kept_versions``, ``pip_check``, ``commands_ok``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SB3_SCRIPT = textwrap.dedent("""
    import sys, torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from rlinfluence.integrations.sb3_rundir import RunDirectoryCallback
    torch.set_num_threads(1)
    model = PPO("MlpPolicy", make_vec_env("CartPole-v1", n_envs=3, seed=1), n_steps=64, batch_size=64, seed=1)
    model.learn(64 * 3 * 5, callback=RunDirectoryCallback(sys.argv[1], eval_episodes=5))
""")


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def versions(python: Path) -> dict[str, str]:
    out = run([str(python), "-c", "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
               "('torch', 'stable-baselines3', 'trl', 'transformers', 'pandas', 'numpy')}))"])
    return json.loads(out.stdout)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--venv", default="/tmp/rlinfluence_beside")
    parser.add_argument("--torch", default="2.13.0")
    parser.add_argument("--keep", action="store_true", help="keep the venv (default: removed at the end)")
    args = parser.parse_args()
    venv = Path(args.venv)
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    start = time.time()
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    for step in ([f"torch=={args.torch}"], ["stable-baselines3", "trl", "pandas", "numpy"]):
        result = run(pip + step)
        if result.returncode:
            sys.exit(f"the user's environment could not be set up ({' '.join(step)}): {result.stderr[-800:]}")
    before = versions(python)
    print(f"user's environment: {before} ({time.time() - start:.0f} s)", flush=True)
    result = run(pip + [str(ROOT)])
    if result.returncode:
        sys.exit(f"pip install of rlinfluence failed: {result.stderr[-800:]}")
    after = versions(python)
    kept = before == after
    print(f"after pip install rlinfluence: {after} ({'unchanged' if kept else 'CHANGED'})", flush=True)
    check = run([str(python), "-m", "pip", "check"])
    work = venv / "work"
    work.mkdir()
    cli = str(bin_dir / "rlinfluence")
    commands = [
        [cli, "train", "--env", "CartPole-v1", "--n-envs", "3", "--n-steps", "64", "--total-timesteps", "960",
         "--eval-episodes", "5", "--save-buffers", "--run-root", str(work / "runs")],
    ]
    ok = 0
    train = run(commands[0], cwd=work)
    print(f"quickstart train: rc {train.returncode}", flush=True)
    ok += train.returncode == 0
    ours = next((work / "runs").glob("*"), None)
    sb3_run = work / "sb3_run"
    sb3 = run([str(python), "-c", SB3_SCRIPT, str(sb3_run)], cwd=work)
    print(f"SB3 PPO + RunDirectoryCallback: rc {sb3.returncode}", flush=True)
    ok += sb3.returncode == 0
    analyses = [["audit", "{run}"], ["attribute", "{run}", "--round", "1"], ["diagnose", "{run}", "--round", "1"],
                ["timeline", "{run}", "--state-index", "0"], ["validate", "{run}", "--round", "1"],
                ["intervene", "{run}", "--rounds", "1", "--eval-episodes", "4"],
                ["explain", "{run}", "--round", "1", "--episodes", "4", "--draws", "2"], ["report", "{run}"]]
    total = 2
    for name, run_dir in (("ours", ours), ("sb3", sb3_run)):
        for analysis in analyses:
            total += 1
            if run_dir is None or not run_dir.is_dir():
                print(f"{name}: {analysis[0]}: no run directory", flush=True)
                continue
            result = run([cli, *(a.format(run=run_dir) for a in analysis)], cwd=work)
            ok += result.returncode == 0
            tail = result.stderr.strip().splitlines()[-1:] if result.returncode else []
            print(f"{name}: {analysis[0]}: rc {result.returncode} {' '.join(tail)}", flush=True)
    if not args.keep:
        shutil.rmtree(venv, ignore_errors=True)
    print(f"kept_versions: {'yes' if kept else 'no'} ({', '.join(f'{k} {v}' for k, v in before.items())})")
    print(f"pip_check: {'clean' if check.returncode == 0 else check.stdout.strip().splitlines()[0]}")
    print(f"commands_ok: {ok}/{total}")


if __name__ == "__main__":
    main()
