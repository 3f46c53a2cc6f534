"""Cost curves of attribution: CPU seconds and peak memory as records, width,
depth grow, ours against the authors' contraction kernel and per-record gradients by vmap(grad).

Measurements (each in a fresh subprocess, one torch thread, its address space capped at
``--memory-cap-gb``; peak memory = the rise of the process's maximum resident set over the call,
i.e. what the call allocated beyond its inputs):

- ``snapshot``: scores of N records for the return target of the same records (the IIF score);
  ours = ``snapshot_influence``; authors = the [N, G, F] contraction of LDA-ORL's
  ``compute_sample_ip_layers_vec`` fed our captured activations (Linear layers only); vmap =
  per-record gradients by ``torch.func.vmap(grad)`` and their dots with the target gradient;
- ``tracin``: full local TracIn over a round's schedule (10 epochs of minibatches of 64, as the
  paper's preset); ours = ``tracin_influence``; vmap = the same sum with the minibatch's per-record
  gradients by vmap(grad) at every step.

Policies: the paper's MLP (tanh, 64-64 actor and critic) on LunarLander-shaped observations (8
floats) and 4 actions; the width (64 -> 1024) and depth (2 -> 4 hidden layers) sweeps at 8192
records; MiniGrid's conv policy on 7x7x3 images. Observations, actions and advantages are random:
the cost does not depend on their values. A method that runs out of memory or past
``--time-cap`` seconds is not run at larger sizes; its row says so.

Rows go to ``--out``/scaling.csv as they are measured (a re-run skips the rows it has), the
figure to docs/figures/attribution-time-by-buffer-size.png. Summary lines last: the fitted exponent a of time ~ N^a
(least squares on log-log over N >= 8192) and the largest size each method completed.

    python benchmarks/speed/influence_scaling.py [--out bench_out/influence_scaling] [--time-cap 120]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pandas as pd
import torch
from torch.func import functional_call, grad, vmap

from rlinfluence.buffer import MinibatchStep
from rlinfluence.influence import snapshot_influence, tracin_influence
from rlinfluence.losses import normalize_advantages
from rlinfluence.policies import make_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness
import harness  # noqa: E402
from influence_speed import (  # noqa: E402  (benchmarks/speed/, beside this file)
    brute_force,
    capture_layers,
    reference_contraction,
)

RECORDS = [2048, 8192, 32768, 131072, 524288, 1048576]
TRACIN_RECORDS = [2048, 4096, 8192, 16384]
WIDTHS = [64, 256, 1024]
DEPTHS = [2, 3, 4]
SWEEP_RECORDS = 8192


def _policy(kind: str, width: int, depth: int) -> torch.nn.Module:
    if kind == "conv":
        return make_policy(gym.spaces.Box(0, 255, (7, 7, 3), dtype="uint8"), gym.spaces.Discrete(3), hidden_sizes=(64,))
    return make_policy(gym.spaces.Box(-1, 1, (8,)), gym.spaces.Discrete(4), hidden_sizes=(width,) * depth)


def _records(kind: str, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    obs = (torch.randint(0, 11, (n, 7, 7, 3), generator=g, dtype=torch.uint8) if kind == "conv"
           else torch.randn(n, 8, generator=g))
    actions = torch.randint(0, 3 if kind == "conv" else 4, (n,), generator=g)
    return obs, actions, torch.randn(n, generator=g)


def measure(scorer: str, method: str, kind: str, n: int, width: int, depth: int) -> dict:
    """One measurement in this process, {cpu_s, wall_s, peak_mb}, after a warm-up call on 256
    records (snapshot) or 2 steps (tracin): torch's first-call costs and the ghost engine's
    one-off verification are not what grows with N."""
    torch.set_num_threads(1)
    policy = _policy(kind, width, depth)
    obs, actions, adv = _records(kind, n)
    if scorer == "snapshot":
        def snapshot(o: torch.Tensor, a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
            weights = normalize_advantages(d.view(-1, 64), dim=1).flatten()
            if method == "ours":
                return snapshot_influence(policy, o, a, d, chunk_size=64)
            if method == "authors":
                train = capture_layers(policy, lambda: -(weights * policy.log_prob(o, a)).sum())
                val = capture_layers(policy, lambda: -(d * policy.log_prob(o, a)).mean())
                return reference_contraction(*train, *val)
            return brute_force(policy, o, a, d, weights)

        snapshot(obs[:256], actions[:256], adv[:256])

        def call() -> torch.Tensor:
            return snapshot(obs, actions, adv)
    else:
        with torch.no_grad():
            logp, _, values = policy.evaluate_actions(obs, actions)
        returns = adv + values
        g = torch.Generator().manual_seed(1)
        schedule = [MinibatchStep(e, perm[i : i + 64], 5e-3) for e in range(10)
                    for perm in [torch.randperm(n, generator=g)] for i in range(0, n, 64)]
        score = tracin_influence if method == "ours" else _vmap_tracin

        def replay(steps: list[MinibatchStep]) -> torch.Tensor:
            return score(policy, obs, actions, logp, adv, returns, values, steps)

        replay(schedule[:2])

        def call() -> torch.Tensor:
            return replay(schedule)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cpu, wall = time.process_time(), time.perf_counter()
    call()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return {"cpu_s": cpu, "wall_s": wall, "peak_mb": peak / 1024}


def _vmap_tracin(policy, obs, actions, logp, adv, returns, values, schedule) -> torch.Tensor:
    """Full TracIn with per-record gradients by vmap(grad) at every step (plain SGD replay)."""
    replica = copy.deepcopy(policy)
    names = [n for n, p in replica.named_parameters() if any(p is q for q in replica.policy_parameters())]
    params = dict(replica.named_parameters())
    influence = torch.zeros(len(adv))

    loss = PPORecordLoss(replica)

    def loss_one(p, *record):
        full = {f"policy.{k}": v.detach() for k, v in params.items()} | {f"policy.{k}": v for k, v in p.items()}
        return functional_call(loss, full, tuple(x[None] for x in record))[0]

    for step in schedule:
        idx = step.indices
        batch = (obs[idx], actions[idx], logp[idx], normalize_advantages(adv[idx]), returns[idx], values[idx])
        target = torch.autograd.grad((adv * replica.log_prob(obs, actions)).mean(), [params[n] for n in names])
        per_record = vmap(grad(loss_one), in_dims=(None, 0, 0, 0, 0, 0, 0))({n: params[n].detach() for n in names}, *batch)
        dots = sum((per_record[n].flatten(1) * t.flatten()).sum(1) for n, t in zip(names, target, strict=True))
        influence.index_add_(0, idx, -dots * step.lr / len(idx))
        replica.zero_grad()
        loss(*batch).mean().backward()
        with torch.no_grad():
            for p in replica.parameters():
                if p.grad is not None:
                    p -= step.lr * p.grad
    return influence


class PPORecordLoss(torch.nn.Module):
    """``forward`` = each record's PPO loss (clip 0.2, vf_coef 0.5, no entropy, the defaults of
    ``tracin_influence``), written out because ``ppo_loss`` reads diagnostics with ``.item()``,
    which vmap refuses."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, obs, actions, old_logp, advantages, returns, old_values) -> torch.Tensor:
        logp, _, value = self.policy.evaluate_actions(obs, actions)
        ratio = torch.exp(logp - old_logp)
        pg = -torch.min(advantages * ratio, advantages * torch.clamp(ratio, 0.8, 1.2))
        return pg + 0.5 * (returns - value).pow(2)


def _run_one(row: dict, memory_cap_gb: float, time_cap: float) -> dict:
    cmd = [sys.executable, __file__, "--one", json.dumps(row), "--memory-cap-gb", str(memory_cap_gb)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=time_cap)
    except subprocess.TimeoutExpired:
        return {**row, "status": f"over {time_cap:.0f} s"}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        status = "out of memory" if "memory" in tail.lower() or "alloc" in tail.lower() else f"failed: {tail[:80]}"
        return {**row, "status": status}
    return {**row, **json.loads(done.stdout.strip().splitlines()[-1]), "status": "ok"}


def _plan() -> list[dict]:
    rows = []
    for method in ("ours", "authors", "vmap"):
        rows += [dict(scorer="snapshot", method=method, kind="mlp", n=n, width=64, depth=2) for n in RECORDS]
        rows += [dict(scorer="snapshot", method=method, kind="mlp", n=SWEEP_RECORDS, width=w, depth=2) for w in WIDTHS[1:]]
        rows += [dict(scorer="snapshot", method=method, kind="mlp", n=SWEEP_RECORDS, width=64, depth=d) for d in DEPTHS[1:]]
    for method in ("ours", "vmap"):
        rows += [dict(scorer="snapshot", method=method, kind="conv", n=n, width=64, depth=1) for n in RECORDS[:4]]
        rows += [dict(scorer="tracin", method=method, kind="mlp", n=n, width=64, depth=2) for n in TRACIN_RECORDS]
    return rows


def _key(row: dict) -> tuple:
    return tuple(row[k] for k in ("scorer", "method", "kind", "n", "width", "depth"))


def _series(done: list[dict], scorer: str, method: str, kind: str) -> list[dict]:
    return sorted((r for r in done if (r["scorer"], r["method"], r["kind"], r["width"], r["depth"]) ==
                   (scorer, method, kind, 64, 2 if kind == "mlp" else 1)), key=lambda r: r["n"])


def _exponent(series: list[dict]) -> float:
    ok = [r for r in series if r["status"] == "ok" and r["n"] >= 8192]
    if len(ok) < 2:
        return math.nan
    return float(np.polyfit(np.log([r["n"] for r in ok]), np.log([r["cpu_s"] for r in ok]), 1)[0])


def _figure(done: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("snapshot", "mlp", "cpu_s"), ("snapshot", "mlp", "peak_mb"), ("snapshot", "conv", "cpu_s"),
              ("tracin", "mlp", "cpu_s")]
    fig, axes = plt.subplots(1, len(panels), figsize=(20, 4.4))
    for (scorer, kind, measure), ax in zip(panels, axes, strict=True):
        for method, style in (("ours", "o-"), ("authors", "s--"), ("vmap", "^:")):
            series = _series(done, scorer, method, kind)
            ok = [r for r in series if r["status"] == "ok"]
            if not ok:
                continue
            stopped = [r for r in series if r["status"] != "ok"]
            label = method + (f" ({stopped[0]['status']} at N={stopped[0]['n']})" if stopped else "")
            ax.loglog([r["n"] for r in ok], [r[measure] for r in ok], style, label=label)
        policy = "MiniGrid conv" if kind == "conv" else "MLP 64-64"
        ax.set(title=f"{scorer}, {policy}", xlabel="records N",
               ylabel="CPU seconds (one thread)" if measure == "cpu_s" else "peak memory beyond the inputs (MB)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--out", default="bench_out/influence_scaling")
    parser.add_argument("--time-cap", type=float, default=120.0, help="seconds per measurement")
    parser.add_argument("--memory-cap-gb", type=float, default=8.0)
    parser.add_argument("--figure", default="docs/figures/attribution-time-by-buffer-size.png")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        cap = int(args.memory_cap_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        row = json.loads(args.one)
        print(json.dumps(measure(**row)))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = out / "scaling.csv"
    done = pd.read_csv(table).to_dict("records") if table.is_file() else []
    have = {_key(r) for r in done}
    stopped: set[tuple] = set()  # (scorer, method, kind, width, depth) that hit a cap
    for row in _plan():
        series = (row["scorer"], row["method"], row["kind"], row["width"], row["depth"])
        if _key(row) in have:
            continue
        if series in stopped or (row["method"] == "authors" and row["kind"] == "conv"):
            continue
        result = _run_one(row, args.memory_cap_gb, args.time_cap)
        print(json.dumps(result), flush=True)
        done.append(result)
        pd.DataFrame(done).to_csv(table, index=False)
        if result["status"] != "ok":
            stopped.add(series)
    _figure(done, Path(args.figure))
    lines = []
    for scorer, kind in (("snapshot", "mlp"), ("snapshot", "conv"), ("tracin", "mlp")):
        for method in ("ours", "authors", "vmap"):
            series = _series(done, scorer, method, kind)
            if not series:
                continue
            ok = [r["n"] for r in series if r["status"] == "ok"]
            failed = [f"{r['status']} at {r['n']}" for r in series if r["status"] != "ok"]
            name = f"{scorer}_{kind}_{method}"
            lines.append(f"{name}_time_exponent: {_exponent(series):.2f}")
            lines.append(f"{name}_largest_n: {max(ok) if ok else 0}" + (f" ({failed[0]})" if failed else ""))
    harness.summary(lines)


if __name__ == "__main__":
    main()
