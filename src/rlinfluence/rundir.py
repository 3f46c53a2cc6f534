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
import io
import json
import os
import re
import secrets
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

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


def _process_umask() -> int:
    """The process's umask (read by setting it and setting it back: there is no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _process_umask()


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, fsync it, then rename it onto
    ``path``; an ``OSError`` (full disk, read-only folder) is a ``UserError`` naming ``path``.

    The temporary file is created exclusively under an unpredictable name (``mkstemp``), so a
    link planted at a predictable name cannot redirect the write, and the rename replaces a link
    at ``path`` rather than writing through it; a folder that is a link (``audit/`` planted to
    point elsewhere) is refused. The file ends with the permissions an ordinary write would give it
    (0666 less the umask), not ``mkstemp``'s owner-only 0600, so that a shared run folder stays
    readable."""
    atomic_write_all([(path, write)])


def atomic_write_all(items: Sequence[tuple[Path, Callable[[Path], None]]]) -> None:
    """``atomic_write`` of several files that belong together (a table and the section that
    describes it): every temporary file is written first, and only once all are written are they
    renamed into place, so a full disk leaves none of them (and the previous versions) in place,
    never one without the other."""
    written: list[tuple[Path, Path]] = []
    try:
        for path, write in items:
            written.append((Path(path), _temporary(Path(path))))
            try:
                write(written[-1][1])
                _fsync(written[-1][1])
                os.chmod(written[-1][1], 0o666 & ~_UMASK)
            except OSError as exc:
                raise UserError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
        for path, tmp in written:
            try:
                os.replace(tmp, path)
                if os.name == "posix":  # the rename itself (Windows cannot open a folder to fsync it)
                    _fsync(path.parent)
            except OSError as exc:
                raise UserError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    finally:
        for _, tmp in written:
            with contextlib.suppress(OSError):  # a read-only folder: nothing was written
                tmp.unlink(missing_ok=True)


def _temporary(path: Path) -> Path:
    """An exclusively created, unpredictably named empty file beside ``path`` (``UserError`` if
    ``path``'s folder is a link or cannot take it)."""
    if path.parent.is_symlink():
        raise UserError(f"cannot write {str(path)!r}: its folder is a link ({str(path.parent)!r} -> "
                        f"{os.readlink(path.parent)!r}); outputs go into real folders only")
    try:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
    except OSError as exc:
        raise UserError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    return Path(name)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
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


def check_output_file(path: str | Path, flag: str = "--out") -> Path:
    """``path`` as an output file: ``UserError`` if it is a directory or a parent is a file."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {str(path)!r} is a directory; give a file name")
    _check_nearest_folder(path, path.parents, flag)
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
    def write_config(self, config: dict[str, Any]) -> None:
        text = json.dumps(config, indent=2, sort_keys=True)
        atomic_write(self.path / "config.json", lambda p: p.write_text(text))

    def read_config(self) -> dict[str, Any]:
        try:
            config = json.loads((self.path / "config.json").read_text())
        except (OSError, ValueError) as exc:  # JSONDecodeError, invalid UTF-8
            raise UserError(f"cannot read {str(self.path / 'config.json')!r}: {exc}") from None
        except RecursionError:
            raise UserError(f"cannot read {str(self.path / 'config.json')!r}: nested too deeply") from None
        if not isinstance(config, dict):
            raise UserError(f"{str(self.path / 'config.json')!r} is not a JSON object of config keys")
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

    # -- checkpoints ------------------------------------------------------------------
    def checkpoint_path(self, n_rounds: int) -> Path:
        return self.path / "checkpoints" / f"{round_name(n_rounds)}.pt"

    def save_checkpoint(self, n_rounds: int, state: dict[str, Any]) -> Path:
        """State after ``n_rounds`` completed rounds; loadable with ``weights_only=True``."""
        path = self.checkpoint_path(n_rounds)

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
        atomic_write(path, lambda p: save_file(tensors, str(p)))
        return path

    def saved_buffer_rounds(self) -> list[int]:
        """The rounds whose buffer is saved (``buffers/round_NNNN.safetensors``), in order; a file
        named otherwise (a copy, ``round_0001 (copy).safetensors``) is not a round and is left out."""
        return saved_round_numbers(self.path / "buffers", ".safetensors")

    def load_buffer(self, round_index: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        path = self.buffer_path(round_index)
        if not path.is_file():
            saved = self.saved_buffer_rounds()
            hint = f"saved rounds: {saved[0]}..{saved[-1]}" if saved else "train with --save-buffers"
            raise UserError(f"no saved buffer for round {round_index} in {str(self.path)!r} ({hint})")
        try:
            tensors = load_file(str(path))
        except Exception as exc:  # safetensors' own error type: corrupt header, truncated data
            raise UserError(f"cannot read buffer {str(path)!r}: {_first_line(exc)}") from None
        _check_buffer(tensors, round_index, path)
        return tensors


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)``; a one-line ``CheckpointError`` if it is unusable."""
    import torch

    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # corrupt zip, truncated or empty file, unpickling refused...
        # torch's own messages suggest weights_only=False, which would run arbitrary code
        text = str(exc)
        if "Unsupported global" in text:
            reason = "it holds objects a weights-only load refuses (not written by rlinfluence)"
        elif isinstance(exc, EOFError) or not Path(path).stat().st_size:
            reason = "the file is empty"
        elif "zip archive" in text or "weights_only" in text or "Weights only" in text:
            reason = "the file is corrupt or truncated"
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
