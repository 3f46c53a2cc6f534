"""A training run's directory: ``config.json``, ``metrics.csv``, TensorBoard events,
per-round checkpoints and (optionally) per-round buffers.

Layout of ``runs/<env>__<method>__<seed>__<time>/``::

    config.json                     the PPOConfig of the run
    metrics.csv                     one row per completed round
    events.out.tfevents.*           TensorBoard: scalars (charts/, losses/, time/; filter/ = the
                                    filter's own statistics), the filter's scores per round as a
                                    histogram (filter/scores) and the config as hparams
    checkpoints/round_0003.pt       theta(3): the state after 3 completed rounds (round_0000 =
                                    the initial policy); torch.load(weights_only=True)
    buffers/round_0003.safetensors  round 3's records and update schedule (``save_buffers``)
    frames/round_0003.npz           a small rendered frame of each of its records
                                    (``save_frames``; ``rlinfluence.frames``)

Every file is written to a temporary name in the same folder, flushed to disk and renamed
into place, so a killed run never leaves a half-written file; ``metrics.csv`` is rewritten whole
each round. Every file read back is checked: an unusable one is a one-line ``UserError``.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import io
import json
import os
import re
import secrets
import shutil
import time
import warnings
import zipfile
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from rlinfluence import identity
from rlinfluence.atomic import atomic_write, atomic_write_all
from rlinfluence.errors import UserError

_LOSS_KEYS = frozenset({"policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction",
                        "explained_variance"})


def metric_tag(key: str, filter_stats: Collection[str] = ()) -> str:
    """The TensorBoard / W&B tag of a metric: ``time/`` for durations, ``filter/`` for the
    statistics the round's filter reported (``filter_stats``), ``losses/`` for the update's
    losses, ``charts/`` for everything else (returns, kept fraction, counts)."""
    if key.endswith("_seconds"):
        group = "time"
    elif key in filter_stats:
        group = "filter"
    else:
        group = "losses" if key in _LOSS_KEYS else "charts"
    return f"{group}/{key}"


def check_wandb_installed() -> None:
    """``UserError`` unless wandb can be imported (``--wandb`` needs the ``wandb`` extra)."""
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise UserError("--wandb needs Weights & Biases: pip install 'rlinfluence[wandb]'")
    # online logging without credentials would fail only after round 0: say so before training
    if os.environ.get("WANDB_MODE", "online") not in ("offline", "disabled", "dryrun") \
            and not os.environ.get("WANDB_API_KEY") and not _netrc_has("api.wandb.ai"):
        raise UserError("--wandb logs online and no W&B key is set: run `wandb login`, set WANDB_API_KEY, "
                        "or log locally with WANDB_MODE=offline")


def _netrc_has(host: str) -> bool:
    """Whether ~/.netrc (or $NETRC) holds credentials for ``host`` (where `wandb login` writes them)."""
    import netrc

    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class CheckpointError(UserError):
    """A checkpoint that cannot be used: unreadable, truncated, or missing or malformed entries."""


@contextlib.contextmanager
def run_lock(path: Path, what: str) -> Iterator[None]:
    """An exclusive advisory lock on the folder ``path`` itself while ``what`` runs (``flock`` on
    the folder, POSIX; elsewhere none): no file is written, and the lock goes with the process.
    ``UserError`` if another process holds it."""
    if os.name != "posix":
        yield
        return
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another {what} is running in {str(path)!r}") from None
        yield
    finally:
        os.close(fd)


def _check_nearest_folder(path: Path, folders: Sequence[Path], flag: str) -> None:
    """``UserError`` unless the first existing one of ``folders`` is a writable directory."""
    for folder in folders:
        if folder.exists():
            if not folder.is_dir():
                raise UserError(f"{flag} {str(path)!r}: {str(folder)!r} is a file, not a directory")
            if not os.access(folder, os.W_OK):
                raise UserError(f"{flag} {str(path)!r}: {str(folder)!r} is not writable")
            return


RUN_FILES = ("config.json", "run.json", "metrics.csv", "wandb_id")
"""A run directory's own files at its top (with ``checkpoints/``, ``buffers/`` and ``frames/``): no
``--out`` may write over them."""
RUN_FOLDERS = ("checkpoints", "buffers", "frames", "completions")


def check_output_file(path: str | Path, flag: str = "--out") -> Path:
    """``path`` as an output file: ``UserError`` if it is a directory, a parent is a file, or it would
    write over a run's own files (its config, identity, metrics, checkpoints, buffers, frames)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {str(path)!r} is a directory; give a file name")
    _check_nearest_folder(path, path.parents, flag)
    resolved = path.resolve()
    in_run = (resolved.name in RUN_FILES and (resolved.parent / "config.json").is_file()) or any(
        folder.name in RUN_FOLDERS and (folder.parent / "config.json").is_file() for folder in resolved.parents)
    if in_run:
        raise UserError(f"{flag} {str(path)!r} is one of a run directory's own files (or in its checkpoints, buffers or "
                        "frames): give another name")
    return path


def check_output_dir(path: str | Path, flag: str = "--out") -> Path:
    """``path`` as an output folder, checked before any work: ``UserError`` if it is a file, a
    parent is a file, or the folder (or its nearest existing parent) is not writable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {str(path)!r} is a file; give a folder")
    _check_nearest_folder(path, [path, *path.parents], flag)
    return path


def round_name(round_index: int) -> str:
    return f"round_{round_index:04d}"


AUDIT_SCORES = Path("audit") / "scores"
"""Where a run's harm tables go, one ``round_K.parquet`` per round (``rlinfluence.analysis.audit``
reads them: written by the SB3 ``AuditCallback``, the LM trainer's ``--audit``, or a user)."""
SPACES_FILE = "spaces.json"
"""The spaces a run's policy was built for (``RunDirectory.write_spaces``)."""

_ROUND_FILE = re.compile(r"round_(\d+)")


def saved_round_numbers(folder: Path, suffix: str) -> list[int]:
    """The k of every ``folder/round_<k><suffix>``, sorted; other files (copies, strays) are left out."""
    found = (_ROUND_FILE.fullmatch(p.name[: -len(suffix)]) for p in folder.glob(f"round_*{suffix}"))
    return sorted(int(m.group(1)) for m in found if m)


class RunDirectory:
    """Reads and writes one run's files; the trainer talks to it after every round."""

    def __init__(self, path: str | Path, tensorboard: bool = True):
        self.path = Path(path)
        self.rows: list[dict[str, Any]] = []
        self._tensorboard = tensorboard
        self._writer = None
        self._wandb_settings: dict[str, Any] | None = None
        self._wandb_run: Any = None
        self._identity: dict[str, Any] | None = None

    def log_to_wandb(self, project: str, config: dict[str, Any]) -> None:
        """Also log every round to Weights & Biases: a W&B run named after this folder, in
        ``project``, with ``config`` as its config (and its ``wandb_group`` and ``wandb_tags``),
        started by the first round logged (offline with ``WANDB_MODE=offline``; W&B's files go to
        ``WANDB_DIR``, default ``./wandb``). Its id is kept in the folder (``wandb_id``), so a
        resumed run continues the same W&B run."""
        check_wandb_installed()
        self._wandb_settings = {"project": project, "name": self.path.name, "config": config,
                                "group": config.get("wandb_group"), "tags": list(config.get("wandb_tags") or ())}

    # -- creation ---------------------------------------------------------------------
    @classmethod
    def create(cls, root: str | Path, env: str, method: str, seed: int, tensorboard: bool = True) -> RunDirectory:
        """Make ``root/<env>__<method>__<seed>__<time>`` (unique); ``UserError`` if unwritable."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = Path(root) / f"{env.replace('/', '-').replace(':', '-')}__{method}__{seed}__{stamp}"
        path, n = base, 1
        while path.exists():
            path, n = base.with_name(f"{base.name}-{n}"), n + 1
        try:
            (path / "checkpoints").mkdir(parents=True)
        except OSError as exc:
            raise UserError(f"cannot create run directory {str(path)!r}: {exc.strerror}") from None
        if not os.access(path, os.W_OK):
            raise UserError(f"run directory {str(path)!r} is not writable")
        return cls(path, tensorboard)

    @classmethod
    def at(cls, path: str | Path, tensorboard: bool = True) -> RunDirectory:
        """Use ``path`` (created if needed) as a new run's directory; ``UserError`` if unwritable."""
        try:
            (Path(path) / "checkpoints").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create run directory {str(path)!r}: {exc.strerror}") from None
        return cls(path, tensorboard)

    @classmethod
    def open_existing(cls, path: str | Path, tensorboard: bool = True) -> RunDirectory:
        """An existing run directory (for resume/analysis); ``UserError`` if it is not one."""
        run = cls(path, tensorboard)
        if not (run.path / "config.json").is_file():
            started = run.path.is_dir() and (run.path / "checkpoints").is_dir()
            hint = (": the run was stopped before its config was written, so no round ran; remove it and "
                    "train again") if started else ""
            raise UserError(f"{str(run.path)!r} is not a run directory (no config.json){hint}")
        metrics = run.path / "metrics.csv"
        if metrics.is_file():
            run.rows = _read_metrics(metrics)
        return run

    def check_writable(self) -> None:
        """``UserError`` unless the run's files can be written (before resuming it): a folder the
        run writes into that is a link (planted to point into another run, or anywhere else) is
        refused before anything is trained, as a folder that is not writable is."""
        for name in ("checkpoints", "buffers", "frames", "completions", "audit", "analyses"):
            folder = self.path / name
            if folder.is_symlink():
                raise UserError(f"{str(folder)!r} is a link (-> {os.readlink(folder)!r}): the run writes into real "
                                "folders only; cannot resume")
        for folder in (self.path, self.path / "checkpoints"):
            if folder.is_dir() and not os.access(folder, os.W_OK):
                raise UserError(f"run directory {str(folder)!r} is not writable: cannot resume")

    # -- config -----------------------------------------------------------------------
    def write_config(self, config: dict[str, Any], written_by: str = identity.TRAIN, spaces: tuple[Any, Any] | None = None
                     ) -> None:
        """Write ``config.json`` and the run's identity (``rlinfluence.identity``: a new run gets its
        id, which every checkpoint and buffer it writes will carry); with ``spaces`` (observation,
        action), ``spaces.json`` too (``write_spaces``)."""
        if spaces is not None:
            self.write_spaces(*spaces)
        text = json.dumps(config, indent=2, sort_keys=True)
        if (self.path / "config.json").is_file() and self.identity is None:  # a run from before run ids stays one
            atomic_write(self.path / "config.json", lambda p: p.write_text(text))
            return
        self._identity = identity.written(self.path, config, written_by)
        atomic_write_all([(self.path / "config.json", lambda p: p.write_text(text)),
                          (self.path / identity.RUN_FILE, lambda p: p.write_text(identity.text(self._identity)))])

    def write_spaces(self, observation_space: Any, action_space: Any) -> None:
        """``spaces.json``: the spaces the run's policy was built for (``envs.space_to_json``), from
        which a run whose env cannot be re-created is still read (``checkpoint.load_round``)."""
        from rlinfluence.envs import space_to_json

        text = json.dumps({"observation": space_to_json(observation_space), "action": space_to_json(action_space)})
        atomic_write(self.path / SPACES_FILE, lambda p: p.write_text(text))

    def read_spaces(self) -> tuple[Any, Any] | None:
        """The (observation, action) spaces of ``spaces.json``, or None (a run written before it, or of
        spaces it does not record)."""
        from rlinfluence.envs import space_from_json

        try:
            data = json.loads((self.path / SPACES_FILE).read_text())
            return space_from_json(data["observation"]), space_from_json(data["action"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @property
    def identity(self) -> dict[str, Any] | None:
        """``run.json``: the run id, what wrote the run, its config (None for a run from before run ids)."""
        if self._identity is None:
            self._identity = identity.read(self.path)
        return self._identity

    @property
    def run_id(self) -> str | None:
        return None if self.identity is None else self.identity["run_id"]

    def read_config(self) -> dict[str, Any]:
        try:
            config = json.loads((self.path / "config.json").read_text())
        except (OSError, ValueError) as exc:  # JSONDecodeError, invalid UTF-8
            raise UserError(f"cannot read {str(self.path / 'config.json')!r}: {exc}") from None
        except RecursionError:
            raise UserError(f"cannot read {str(self.path / 'config.json')!r}: nested too deeply") from None
        if not isinstance(config, dict):
            raise UserError(f"{str(self.path / 'config.json')!r} is not a JSON object of config keys")
        identity.check_config(self.path, config, self.identity)
        return config

    # -- metrics ----------------------------------------------------------------------
    def log_round(self, metrics: dict[str, Any], filter_stats: Collection[str] = (),
                  scores: torch.Tensor | None = None) -> None:
        """Append one round's row to ``metrics.csv`` (rewritten atomically), TensorBoard and
        W&B. ``filter_stats``: the keys of ``metrics`` the filter reported (tagged ``filter/``);
        ``scores``: the filter's per-record scores of the round, logged as a histogram."""
        self.rows.append(metrics)
        columns = list(dict.fromkeys(key for row in self.rows for key in row))
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        atomic_write(self.path / "metrics.csv", lambda p: p.write_text(buf.getvalue()))
        tags = {metric_tag(key, filter_stats): value for key, value in metrics.items()
                if key not in ("round", "env_steps") and isinstance(value, int | float)}
        step = int(metrics["env_steps"])
        if self._tensorboard:
            self._log_tensorboard(tags, step, scores)
        if self._wandb_settings is not None:
            self._log_wandb(tags, step, scores)

    def truncate(self, n_rounds: int) -> None:
        """Forget rows of rounds >= ``n_rounds`` (used when resuming from a checkpoint);
        ``UserError`` unless the rows left are rounds 0..n_rounds-1 (each once: ``_read_metrics``
        refuses a round written twice)."""
        self.rows = [row for row in self.rows if row["round"] < n_rounds]
        rounds = [row["round"] for row in self.rows]
        if rounds != list(range(n_rounds)):
            missing = sorted(set(range(n_rounds)) - set(rounds))
            problem = f"rows missing for rounds {_spans(missing)}" if missing else "rounds out of order"
            raise UserError(f"{str(self.path / 'metrics.csv')!r} does not match the checkpoint of "
                            f"round {n_rounds} ({problem}): restore it or start a new run")

    def _log_tensorboard(self, tags: dict[str, float], step: int, scores: torch.Tensor | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if self._writer is None:  # purge_step: a resumed run's redone rounds replace the old events
            self._writer = SummaryWriter(str(self.path), purge_step=step)
            if len(self.rows) == 1 and (self.path / "config.json").is_file():  # a fresh run
                self._log_hparams([tag for tag in tags if tag.startswith("charts/")])
        for tag, value in tags.items():
            self._writer.add_scalar(tag, value, step)
        if scores is not None and len(scores):
            self._writer.add_histogram("filter/scores", scores.double(), step)
        self._writer.flush()

    def _log_hparams(self, metric_tags: list[str]) -> None:
        """The config as TensorBoard hparams (its HPARAMS tab), the ``metric_tags`` beside it."""
        from torch.utils.tensorboard.summary import hparams

        values = {key: value if isinstance(value, bool | int | float | str) else json.dumps(value)
                  for key, value in self.read_config().items()}
        for summary in hparams(values, dict.fromkeys(metric_tags, 0.0)):
            self._writer.file_writer.add_summary(summary)

    def _log_wandb(self, tags: dict[str, float], step: int, scores: torch.Tensor | None) -> None:
        import wandb

        if self._wandb_run is None:
            id_file = self.path / "wandb_id"
            run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
            if not id_file.is_file():
                atomic_write(id_file, lambda p: p.write_text(run_id))
            self._wandb_run = wandb.init(id=run_id, resume="allow", **self._wandb_settings)
        data: dict[str, Any] = dict(tags)
        if scores is not None and len(scores):
            data["filter/scores"] = wandb.Histogram(scores.double().numpy())
        self._wandb_run.log(data, step=step)

    def close(self) -> None:
        """Flush and close the TensorBoard writer and finish the W&B run (a later round logged
        opens new ones)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def check_room(self, rounds: int, bytes_per_round: dict[str, int]) -> None:
        """``UserError`` if ``rounds`` more rounds, each writing about ``bytes_per_round`` (what ->
        bytes), would not fit in the free space of the run's disk, said with the estimate."""
        per_round = sum(bytes_per_round.values())
        free = shutil.disk_usage(self.path).free
        if rounds * per_round > free:
            what = ", ".join(k for k, v in bytes_per_round.items() if v)
            raise UserError(f"this run would write about {_size(rounds * per_round)} ({rounds} rounds x "
                            f"{_size(per_round)} of {what}), but {str(self.path)!r} has {_size(free)} free: "
                            "lower --total-timesteps (or save fewer files)")

    # -- checkpoints ------------------------------------------------------------------
    def checkpoint_path(self, n_rounds: int) -> Path:
        return self.path / "checkpoints" / f"{round_name(n_rounds)}.pt"

    def save_checkpoint(self, n_rounds: int, state: dict[str, Any]) -> Path:
        """State after ``n_rounds`` completed rounds; loadable with ``weights_only=True``."""
        path = self.checkpoint_path(n_rounds)
        if self.run_id is not None:
            state = {**state, "run_id": self.run_id}

        import torch  # here, not at import: the command line reads run folders without torch

        def save(tmp: Path) -> None:
            try:
                torch.save(state, tmp)
            except RuntimeError as exc:  # torch reports a failed write (a full disk) this way
                raise OSError(_first_line(exc)) from None

        atomic_write(path, save)
        return path

    def checkpoints(self) -> list[Path]:
        """The run's checkpoints, newest first; ``UserError`` if there is none."""
        paths = sorted((self.path / "checkpoints").glob("round_*.pt"), reverse=True)
        if not paths:
            raise UserError(f"no checkpoint in {str(self.path / 'checkpoints')!r} to resume from")
        return paths

    def latest_checkpoint(self) -> Path:
        return self.checkpoints()[0]

    # -- buffers ----------------------------------------------------------------------
    def buffer_path(self, round_index: int) -> Path:
        return self.path / "buffers" / f"{round_name(round_index)}.safetensors"

    def save_buffer(self, round_index: int, tensors: dict[str, torch.Tensor]) -> Path:
        from safetensors.torch import save_file

        path = self.buffer_path(round_index)
        path.parent.mkdir(exist_ok=True)
        metadata = None if self.run_id is None else {"run_id": self.run_id}
        atomic_write(path, lambda p: save_file(tensors, str(p), metadata=metadata))
        return path

    def read_checkpoint(self, path: Path) -> dict[str, Any]:
        """A checkpoint of this run (``load_checkpoint``), refused if it carries another run's id."""
        state = load_checkpoint(path)
        identity.check_file(self.identity, state.get("run_id"), path, "checkpoint", CheckpointError)
        return state

    def saved_buffer_rounds(self) -> list[int]:
        """The rounds whose buffer is saved (``buffers/round_NNNN.safetensors``), in order; a file
        named otherwise (a copy, ``round_0001 (copy).safetensors``) is not a round and is left out."""
        return saved_round_numbers(self.path / "buffers", ".safetensors")

    def load_buffer(self, round_index: int) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        path = self.buffer_path(round_index)
        if not path.is_file():
            saved = self.saved_buffer_rounds()
            hint = f"saved rounds: {_spans(saved)}" if saved else "train with --save-buffers"
            raise UserError(f"no saved buffer for round {round_index} in {str(self.path)!r} ({hint})")
        try:
            with safe_open(str(path), framework="pt") as file:
                tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 (not a dict)
                run_id = (file.metadata() or {}).get("run_id")
        except Exception as exc:  # safetensors' own error type: corrupt header, truncated data
            raise UserError(f"cannot read buffer {str(path)!r}: {_first_line(exc)}") from None
        _check_buffer(tensors, round_index, path)
        identity.check_file(self.identity, run_id, path, "buffer")
        return tensors


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)``; a one-line ``CheckpointError`` if it is unusable."""
    import torch

    try:
        with warnings.catch_warnings():  # torch's warning about a foreign pickle protocol: the refusal says it
            warnings.simplefilter("ignore")
            state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # corrupt zip, truncated or empty file, unpickling refused...
        # torch's own messages suggest weights_only=False, which would run arbitrary code
        text = str(exc)
        if ("Unsupported global" in text or "Unsupported operand" in text) and _holds_pickle(Path(path)):
            reason = ("the weights-only load refused it: it holds a pickle of objects or code, not tensors "
                      "(not written by rlinfluence; nothing in it was run)")
        elif isinstance(exc, EOFError) or not Path(path).stat().st_size:
            reason = "the file is empty"
        elif "zip archive" in text or "weights_only" in text or isinstance(exc, OSError) and exc.errno == errno.EINVAL:
            reason = "the file is corrupt or truncated"  # a cut zip reads as an invalid seek (EINVAL)
        else:
            reason = _first_line(exc)
        raise CheckpointError(f"cannot load checkpoint {str(path)!r}: {reason}") from None
    if not isinstance(state, dict) or "policy" not in state:
        raise CheckpointError(f"{str(path)!r} is not an rlinfluence checkpoint")
    return state


_BUFFER_KEYS = ("record_ids", "obs", "actions", "rewards", "terminated", "truncated", "logp", "values", "final_values",
                "episode_ids", "last_values", "advantages", "keep")
_SCHEDULE_KEYS = ("schedule_epochs", "schedule_indices", "schedule_lr")
"""A round's minibatch schedule: all three, or none (an SB3 round's)."""


def _check_buffer(tensors: dict[str, torch.Tensor], round_index: int, path: Path) -> None:
    """``UserError`` if a saved buffer lacks a field, its fields disagree in length, or it is
    another round's."""
    missing = [key for key in _BUFFER_KEYS if key not in tensors]
    if missing:
        raise UserError(f"buffer {str(path)!r} lacks {', '.join(missing)} (not a saved round)")
    schedule = [key for key in _SCHEDULE_KEYS if key in tensors]
    if schedule and len(schedule) < len(_SCHEDULE_KEYS):
        absent = next(key for key in _SCHEDULE_KEYS if key not in tensors)
        raise UserError(f"buffer {str(path)!r} lacks {absent} beside {schedule[0]} (a minibatch schedule is saved whole)")
    ids = tensors["record_ids"]
    if ids.ndim != 2 or ids.shape[1] != 3 or not len(ids):
        raise UserError(f"buffer {str(path)!r} has malformed record_ids of shape {tuple(ids.shape)}")
    lengths = {key: len(value) for key, value in tensors.items()
               if key not in ("last_values",) and not key.startswith("schedule_")}
    wrong = sorted(key for key, n in lengths.items() if n != len(ids))
    if wrong:
        raise UserError(f"buffer {str(path)!r}: {wrong[0]} has {lengths[wrong[0]]} records, "
                        f"record_ids {len(ids)}")
    if int(ids[0, 0]) != round_index:
        raise UserError(f"buffer {str(path)!r} holds round {int(ids[0, 0])}, not {round_index}")


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    """``metrics.csv`` as rows of numbers (an empty or NaN cell is left out; an empty file, no
    rows); ``UserError`` naming the line and column of the first cell that is not a number, the
    line of a round written twice, or a file that is not such a CSV."""
    import pandas as pd

    try:
        frame = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        return []
    except (OSError, UnicodeDecodeError, pd.errors.ParserError) as exc:
        raise UserError(f"cannot read {str(path)!r}: {_first_line(exc)}") from None
    if "round" not in frame.columns:
        raise UserError(f"{str(path)!r} has no 'round' column (columns: {', '.join(map(str, frame.columns[:5]))})")
    for column in frame.columns:
        if not pd.api.types.is_numeric_dtype(frame[column]):
            cells = frame[column]
            bad = cells[cells.notna() & pd.to_numeric(cells, errors="coerce").isna()]
            raise UserError(f"{str(path)!r} line {bad.index[0] + 2}, column {column!r}: "
                            f"{bad.iloc[0]!r} is not a number")
    rounds = frame["round"]
    wrong = rounds.isna() | (rounds < 0) | (rounds != rounds.round())
    if wrong.any():
        line = int(wrong.to_numpy().argmax())
        raise UserError(f"{str(path)!r} line {line + 2}: round {rounds.iloc[line]!r} is not a round number")
    frame["round"] = rounds.astype(int)
    again = frame["round"].duplicated()
    if again.any():  # the trainer writes each round once: a second row is an edit or another run's
        line = int(again.to_numpy().argmax())
        raise UserError(f"{str(path)!r} line {line + 2}: round {int(frame['round'].iloc[line])} has a row already "
                        "(each round is written once: was the file edited, or did two trainings write into it?)")
    return [{key: value for key, value in row.items() if not pd.isna(value)}
            for row in frame.to_dict("records")]


def _spans(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0..2, 5``."""
    spans: list[str] = []
    for v in values:
        if spans and int(spans[-1].split("..")[-1]) == v - 1:
            spans[-1] = f"{spans[-1].split('..')[0]}..{v}"
        else:
            spans.append(str(v))
    return ", ".join(spans)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _size(n: float) -> str:
    """``n`` bytes as a person reads it: 512 B, 3.1 MB, 4.7e+06 TB."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"


def _holds_pickle(path: Path) -> bool:
    """Whether ``path`` is a whole pickle: torch's zip format, or a bare pickle (protocol 2 or later
    starts with 0x80). A cut zip or other bytes also trip the weights-only unpickler, but hold no payload."""
    with path.open("rb") as file:
        head = file.read(1)
    return head == b"\x80" or zipfile.is_zipfile(path)
