"""What kind of fault a flagged source's signature points to: the fault classes, the evidence each
family carries for or against them, and ``reading``, the verdict's last step
(``rlinfluence.sources.verdict``; a change here bumps ``rlinfluence.sources.VERDICT_VERSION``). No
torch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

FAULT_CLASSES = ("stale-policy", "observation", "action", "environment", "sampling", "done-flags", "reward",
                 "unexplained", "undetermined")
KIND_CLASS = {"stale": "stale-policy", "obs-bug": "observation", "action-mismatch": "action",
              "logp-mismatch": "sampling", "done-flag": "done-flags", "reward-delay": "reward",
              "reward-flip": "reward", "reward-noise": "reward", "trigger": "reward"}
"""The fault class each corruption kind belongs to (``rlinfluence.corruptions``): the truth a reading is judged by."""

SUPPORT = 0.05
"""A family supports a reading without flagging the source when its unadjusted p-value is below this."""

_BEHAVIOUR = frozenset({"action", "sampling", "stale-policy", "observation", "environment"})
"""Classes that change how a worker behaves, and so which states it visits, how its episodes end and
what rewards it gets: each can move the families that summarise those."""
EXPLAINS: dict[str, frozenset[str]] = {
    "reward-recheck": frozenset({"reward"}),
    "logp-gap": frozenset({"stale-policy"}),
    "value-gap": frozenset({"stale-policy"}),
    "action-surprise": frozenset({"sampling", "action", "stale-policy"}),
    "action-calibration": frozenset({"sampling", "action", "stale-policy"}),
    "dynamics": frozenset({"action", "observation", "environment"}),
    "action-fit": frozenset({"action", "observation"}),
    "lag-fit": frozenset({"action", "observation"}),
    "obs-shift": _BEHAVIOUR | {"done-flags"},
    "termination": frozenset({"done-flags", "observation", "action", "environment"}),
    "truncations": _BEHAVIOUR | {"done-flags"},
    "reward-model": frozenset({"reward", "action", "observation", "environment"}),
    "reward-extremes": _BEHAVIOUR | {"reward", "done-flags"},
    "td-error": _BEHAVIOUR | {"reward", "done-flags"},
}
"""The fault classes that can make each family flag a source (the families not listed, the gradient
and advantage families, can be moved by every class and carry no class information). ``truncations``
above the other sources' share (more episode ends reported as time-limit ends) is explained by
done flags alone (``reading``)."""

_EVIDENCE = {
    "logp-gap": "its logged log-probs or values are not the current policy's",
    "value-gap": "its logged log-probs or values are not the current policy's",
    "action-surprise": "its logged actions are not samples of the policy it logs",
    "action-calibration": "its logged actions are not samples of the policy it logs",
    "dynamics": "its transitions do not follow from its logged (state, action)",
    "action-fit": "another action than the logged one explains its transitions",
    "lag-fit": "the action before the logged one explains its transitions",
    "obs-shift": "its observations are distributed unlike the other workers'",
    "termination": "its episode ends disagree with the states they happen in",
    "truncations": "its share of episode ends reported as time-limit ends differs from the others'",
    "reward-model": "its rewards disagree with its logged (state, action)",
    "reward-extremes": "its rewards are distributed unlike the other workers'",
    "td-error": "its one-step value errors differ from the others'",
    "reward-recheck": "its logged rewards are not what the reward function gives its completions",
}
_CLASS_TEXT = {
    "stale-policy": ("a stale or lagging worker, or one that logs another policy's numbers",
                     "logp-gap / value-gap: compare its logged log-probs and values with theta(k)'s"),
    "observation": ("its observations do not follow the state (preprocessing: scale, order, rounding, a stale "
                    "buffer)", "print a few of its raw observations beside a healthy worker's from the same state"),
    "action": ("the env executes another action than the logged one (an actuator, mapping, clipping or logging "
               "bug)", "action-fit: does another action explain its transitions"),
    "environment": ("its env's own dynamics differ (physics, version, configuration)",
                    "step its env and a healthy one from one state with one action sequence"),
    "sampling": ("it samples from another distribution than it logs (temperature, an inference engine)",
                 "transitions that follow from its logged actions while its actions are not the policy's"),
    "done-flags": ("its terminated / truncated flags are wrong (or its time limit differs)",
                   "truncations / termination: its episode ends against its states and time limit"),
    "reward": ("its reward differs (timing, scale, sign, assignment)",
               "reward-model with transitions that follow: compare its rewards with a healthy worker's"),
}
_LAG_CHECK = ("an observation lag shows each episode's first observation twice (its second equals its first), "
              "an actuator lag does not: compare the first two observations of a few of its episodes")


def reading(signature: Sequence[str], p_values: Mapping[str, float] | None = None,
            directions: Mapping[str, float] | None = None) -> tuple[str, str, str]:
    """(fault class, a plain-language reading, the candidate classes ``;``-joined) of the families that
    flag a source (its ``signature``).

    The candidates are the classes that every informative flagging family can be explained by:
    C = intersection over f in the signature of ``EXPLAINS[f]`` (``truncations`` with its share
    above the others', ``directions[f] > 0``: done flags only). Two rules then use what the
    mechanism of a class implies for a family that does not flag (its unadjusted p in ``p_values``,
    "supported" when below ``SUPPORT``):

    - an executed action that differs moves ``action-fit`` with ``dynamics`` (the transition fits
      the executed action, not the logged one): ``dynamics`` flagging with neither ``action-fit`` nor
      ``lag-fit`` supported leaves action out. (Version 2 had a second rule, ``action-fit``
      supported without ``lag-fit`` leaves observation out; rounded observations broke it.)

    One candidate left: that class, named. Several: "undetermined", the evidence and each candidate
    with the check that tells it apart. None (flagging families that no single class explains, or
    a rule that leaves out the last one: more than one fault, or a fault outside the classes):
    "undetermined" with the classes named by the most specific families (or left before the rule).
    A signature of families that carry no class information (gradient and advantage families
    only): "undetermined" among every class, since no consistency check flags it (most often a
    reward or objective the other workers do not share, but a fault whose records stay consistent,
    a flaky actuator among them, reads the same).
    """
    flagged = list(dict.fromkeys(signature))
    if not flagged:
        return "", "", ""
    p_values, directions = p_values or {}, directions or {}

    def supported(family: str) -> bool:
        return family in flagged or p_values.get(family, 1.0) < SUPPORT

    informative = [f for f in flagged if f in EXPLAINS]
    if not informative:
        every = [c for c in FAULT_CLASSES if c in _CLASS_TEXT]
        return "undetermined", ("no consistency check flags it, but its updates oppose the other workers': most "
                                "often a reward or objective they do not share (tells: "
                                f"{_CLASS_TEXT['reward'][1]}), or a fault whose records stay consistent"), ";".join(every)
    sets = [frozenset({"done-flags"}) if f == "truncations" and directions.get(f, 0.0) > 0 else EXPLAINS[f]
            for f in informative]
    candidates = frozenset.intersection(*sets)
    ruled_out = set()
    if "dynamics" in flagged and not supported("action-fit") and not supported("lag-fit"):
        ruled_out.add("action")
    evidence = "; ".join(dict.fromkeys(_EVIDENCE[f] for f in informative))
    conflict = not candidates - ruled_out
    if not candidates:  # no one class explains every flagging family: the most specific ones' classes
        smallest = min(len(s) for s in sets)
        candidates = frozenset().union(*(s for s in sets if len(s) == smallest))
    elif not conflict:
        candidates -= ruled_out
    ordered = [c for c in FAULT_CLASSES if c in candidates]
    if len(ordered) == 1 and not conflict:
        return ordered[0], f"{evidence}: {_CLASS_TEXT[ordered[0]][0]}", ordered[0]
    options = [f"{c}, {_CLASS_TEXT[c][0]} (tells: {_CLASS_TEXT[c][1]})" for c in ordered]
    if set(ordered) == {"action", "observation"} and supported("lag-fit"):
        options = [f"an observation lag or an actuator lag (tells: {_LAG_CHECK})"]
    lead = ("no one class explains all of it (two faults, or one outside the classes); the most specific evidence "
            "points at" if conflict else "the evidence does not separate")
    return "undetermined", f"{evidence}; {lead}: " + " | ".join(options), ";".join(ordered)
