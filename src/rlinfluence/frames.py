"""Rendered frames of the saved rounds' records (``rlinfluence train --save-buffers --save-frames``).

With ``PPOConfig.save_frames`` the training envs are built with ``render_mode="rgb_array"`` and,
during collection, every env is rendered before each step: the frame of record (env, step)
shows the state whose observation the record holds. Frames are downscaled to at most
``MAX_SIDE`` pixels on their long side and saved per round as

    frames/round_0003.npz    ``frames``: uint8 [N, H, W, 3] in the buffer's flat (env-major)
                             order, record i = env * n_steps + step (``RolloutBuffer.flat``)

(``numpy.savez_compressed``). ``check_renders`` refuses an env without ``rgb_array`` rendering
before training starts; ``load_frames`` reads the frames back, ``None`` if the round has none;
``record_strip`` gives the records around one record in its episode, ``png`` encodes a frame.
"""

from __future__ import annotations

import io
import os
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rlinfluence.errors import UserError
from rlinfluence.rundir import atomic_write, round_name

if TYPE_CHECKING:
    import gymnasium as gym

MAX_SIDE = 96
"""long side, in pixels, of a stored frame"""
FRAMES_DIR = "frames"
HOW_TO_SAVE = ("frames are saved by `rlinfluence train ... --save-buffers --save-frames` (a run written by another "
               "trainer, such as SB3's RunDirectoryCallback, has none)")


def downscale(frame: np.ndarray, max_side: int = MAX_SIDE) -> np.ndarray:
    """An RGB ``frame [H, W, 3]`` resized (antialiased) so that its long side is at most ``max_side``."""
    from PIL import Image

    height, width = frame.shape[:2]
    factor = max_side / max(height, width)
    if factor >= 1:
        return np.ascontiguousarray(frame[..., :3], dtype=np.uint8)
    size = (max(1, round(width * factor)), max(1, round(height * factor)))
    return np.asarray(Image.fromarray(np.asarray(frame[..., :3], dtype=np.uint8)).resize(size, Image.Resampling.BOX))


def check_renders(env_id: str) -> None:
    """``UserError`` unless ``env_id`` renders ``rgb_array`` frames."""
    from rlinfluence.envs import make_env

    try:
        with warnings.catch_warnings():  # gymnasium's warning says what the error below will
            warnings.simplefilter("ignore")
            env = make_env(env_id, render_mode="rgb_array")
    except TypeError:  # its constructor takes no render_mode
        modes = []
    else:
        modes = env.metadata.get("render_modes", [])
        env.close()
    if "rgb_array" not in modes:
        raise UserError(f"{env_id} renders no rgb_array frames (render modes: {', '.join(modes) or 'none'}): "
                        "train it without --save-frames")


class FrameRecorder:
    """One downscaled frame per (step, env) of a round's collection."""

    def __init__(self, n_steps: int, n_envs: int):
        self.n_steps, self.n_envs = n_steps, n_envs
        # rgb_array frames need no display: without SDL's offscreen video driver pygame looks for
        # one and, on a headless machine, prints "error: XDG_RUNTIME_DIR is invalid or not set"
        # (the "dummy" driver would be silent too, but highway-env then renders black frames)
        os.environ.setdefault("SDL_VIDEODRIVER", "offscreen")
        self._frames: np.ndarray | None = None
        # the time spent rendering: not training, so the trainer leaves it out of its clocks
        self.seconds, self.cpu_seconds = 0.0, 0.0

    def capture(self, step: int, envs: gym.vector.VectorEnv) -> None:
        """Render every env of the vector env ``envs`` (built with ``render_mode="rgb_array"``)
        as the frames of ``step``."""
        start, cpu = time.perf_counter(), time.process_time()
        frames = [downscale(np.asarray(f)) for f in envs.render()]
        if self._frames is None:
            self._frames = np.zeros((self.n_steps, self.n_envs, *frames[0].shape), dtype=np.uint8)
        self._frames[step] = np.stack(frames)
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.process_time() - cpu

    def flat(self) -> np.ndarray:
        """The frames ``[N, H, W, 3]`` in flat (env-major) order."""
        if self._frames is None:
            raise ValueError("no frame was captured")
        return self._frames.transpose(1, 0, 2, 3, 4).reshape(-1, *self._frames.shape[2:])


def frames_path(run_dir: str | Path, round_index: int) -> Path:
    return Path(run_dir) / FRAMES_DIR / f"{round_name(round_index)}.npz"


def save_frames(run_dir: str | Path, round_index: int, frames: np.ndarray) -> Path:
    """Write round ``round_index``'s frames (flat order) compressed, atomically."""
    path = frames_path(run_dir, round_index)
    path.parent.mkdir(exist_ok=True)

    def write(tmp: Path) -> None:
        with tmp.open("wb") as f:
            np.savez_compressed(f, frames=frames)

    atomic_write(path, write)
    return path


def load_frames(run_dir: str | Path, round_index: int, n_records: int | None = None) -> np.ndarray | None:
    """Round ``round_index``'s frames ``[N, H, W, 3]`` (None if it has none); ``UserError`` if
    the file is unreadable or (given ``n_records``) does not hold one frame per record."""
    path = frames_path(run_dir, round_index)
    if not path.is_file():
        return None
    try:
        with np.load(path) as data:
            frames = data["frames"]
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"cannot read frames {str(path)!r}: {exc}") from None
    if frames.ndim != 4 or frames.dtype != np.uint8 or (n_records is not None and len(frames) != n_records):
        raise UserError(f"frames {str(path)!r} hold {frames.shape} {frames.dtype}, not one RGB frame per "
                        f"record ({n_records} records)")
    return frames


def record_strip(index: int, env_ids: np.ndarray, episode_ids: np.ndarray, steps: np.ndarray,
                 width: int = 3) -> np.ndarray:
    """Flat indices of the records of ``index``'s episode at most ``width`` steps before or after
    it, in step order (the episode cut at the round's ends)."""
    same = (env_ids == env_ids[index]) & (episode_ids == episode_ids[index])
    near = same & (np.abs(steps - steps[index]) <= width)
    found = np.flatnonzero(near)
    return found[np.argsort(steps[found], kind="stable")]


def png(frame: np.ndarray) -> bytes:
    """An RGB frame as PNG bytes."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(frame).save(out, format="PNG", optimize=True)
    return out.getvalue()
