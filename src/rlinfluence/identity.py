"""A run's identity: the files of one run prove they belong together.

``run.json``, beside ``config.json``, holds a random run id, what wrote the run, and the config as
it was last written by the run itself::

    {"run_id": "9f1c...", "written_by": "rlinfluence train", "config": {...}}

Every checkpoint carries the id (``state["run_id"]``) and every saved buffer too (its safetensors
metadata ``run_id``), written when the file is written. Every reader checks them: a checkpoint or
buffer copied in from another run is refused with one line, and so is a ``config.json`` edited
after the run (the line names the changed fields); set ``RLINFLUENCE_ACCEPT_EDITED_CONFIG=1`` to read
an edited config on purpose, with a warning naming them. A run written before run ids existed has
no ``run.json`` and is read as before.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from rlinfluence.errors import UserError

RUN_FILE = "run.json"
ACCEPT_EDITED_CONFIG = "RLINFLUENCE_ACCEPT_EDITED_CONFIG"
TRAIN = "rlinfluence train"
"""``written_by`` of the project's own trainer (``rlinfluence train``, ``PPO.learn``)."""


def read(run_path: Path) -> dict[str, Any] | None:
    """The run's identity (``run.json``), or None for a run written before run ids existed."""
    path = run_path / RUN_FILE
    if not path.is_file():
        return None
    try:
        identity = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise UserError(f"cannot read {str(path)!r}: {exc}") from None
    if not isinstance(identity, dict) or not isinstance(identity.get("run_id"), str) \
            or not isinstance(identity.get("config"), dict):
        raise UserError(f"{str(path)!r} is not a run identity (run_id, written_by, config)")
    return identity


def written(run_path: Path, config: dict[str, Any], written_by: str) -> dict[str, Any]:
    """The identity to write with ``config``: a new run gets a fresh id (and, for an env given as an
    entry point, the package it comes from with its version: ``envs.env_package``); a run keeps its
    id and writer."""
    from rlinfluence.envs import env_package

    as_read = json.loads(json.dumps(config))  # as config.json reads back: tuples as lists
    existing = read(run_path)
    if existing is None:
        existing = {"run_id": uuid.uuid4().hex, "written_by": written_by, "env_package": env_package(config.get("env", ""))}
    return {**existing, "config": as_read}


def text(identity: dict[str, Any]) -> str:
    return json.dumps(identity, indent=2, sort_keys=True)


def check_config(run_path: Path, config: dict[str, Any], identity: dict[str, Any] | None) -> None:
    """``UserError`` naming the changed fields if ``config`` (read from config.json) is not what the
    run wrote (``identity``); with ``RLINFLUENCE_ACCEPT_EDITED_CONFIG=1`` a warning instead."""
    if identity is None:
        return
    saved = identity["config"]
    changed = sorted(k for k in saved.keys() | config.keys() if saved.get(k, _ABSENT) != config.get(k, _ABSENT))
    if not changed:
        return
    fields = ", ".join(f"{k} {_shown(saved.get(k, _ABSENT))} -> {_shown(config.get(k, _ABSENT))}" for k in changed[:4])
    more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
    where = str(run_path / "config.json")
    if os.environ.get(ACCEPT_EDITED_CONFIG) == "1":
        print(f"warning: {where!r} was edited after the run ({fields}{more}): read as edited", file=sys.stderr)
        return
    raise UserError(f"{where!r} was edited after the run ({fields}{more}); the run's files were made with the "
                    f"config in {RUN_FILE}: restore it, or set {ACCEPT_EDITED_CONFIG}=1 to read the edit on purpose")


def check_file(identity: dict[str, Any] | None, found: str | None, path: Path, what: str,
               error: type[UserError] = UserError) -> None:
    """``error`` if the ``what`` at ``path`` (a checkpoint, a buffer) carries another run's id
    (``found``), or none in a run that has one (``identity``)."""
    if identity is None or found == identity["run_id"]:
        return
    whose = f"run id {found[:8]}" if isinstance(found, str) else "no run id"
    raise error(f"{what} {str(path)!r} is not this run's ({whose}; this run is {identity['run_id'][:8]}): "
                    "a file copied from another run?")


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


_ABSENT = _Absent()


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, _Absent) else json.dumps(value)
