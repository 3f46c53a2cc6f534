"""The package installs beside a user's torch, SB3 or TRL: the base dependencies are ranges, the
env suites and rliable are extras, and the core trains and audits without them (each missing one
is a one-line error naming its extra)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"


def test_base_dependencies_are_ranges_without_the_env_suites_or_rliable():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    base = project["dependencies"]
    assert not [d for d in base if "==" in d], base
    names = {d.split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip() for d in base}
    assert not names & {"minigrid", "highway-env", "rliable", "stable-baselines3", "trl", "transformers"}
    assert not [d for d in base if "box2d" in d]
    extras = project["optional-dependencies"]
    assert {"envs", "aggregate", "all"} <= set(extras) and "rlinfluence[envs,aggregate]" in extras["dev"]


def test_the_core_trains_and_audits_without_the_extras(tmp_path):
    """Importing minigrid, highway_env, Box2D or rliable fails in this interpreter: a CartPole run
    with its audit still works, and a MiniGrid env or aggregate is one line naming the extra."""
    script = textwrap.dedent(f"""
        import sys
        for name in ("minigrid", "highway_env", "Box2D", "rliable"):
            sys.modules[name] = None  # import fails, and find_spec says it is missing
        import importlib.util
        real = importlib.util.find_spec
        importlib.util.find_spec = lambda n, *a: None if n in ("minigrid", "highway_env", "Box2D", "rliable") else real(n, *a)
        from rlinfluence import PPO, PPOConfig
        from rlinfluence.errors import UserError
        from rlinfluence.envs import make_env
        run = PPO(PPOConfig(env="CartPole-v1", n_envs=4, n_steps=32, batch_size=32, total_timesteps=128,
                            eval_episodes=0, save_buffers=True, progress=False, run_root={str(tmp_path)!r})).learn().run
        from rlinfluence.analysis.audit import audit_run
        audit_run(run.path, scorer="negative-advantage")
        for attempt in (lambda: make_env("MiniGrid-Empty-5x5-v0"),
                        lambda: __import__("rlinfluence.experiments.aggregate", fromlist=["x"]).aggregate([], "{tmp_path}/agg")):
            try:
                attempt()
            except UserError as exc:
                print("ERROR", exc)
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    errors = [line for line in out.stdout.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 2 and "rlinfluence[envs]" in errors[0] and "rlinfluence[aggregate]" in errors[1]
