"""Figures quoted in prose, checked against the committed data they come from.

A figure in a page is written between markers that name where it comes from:

    the oracle gains <!-- fig:reward_flip_tuned_summary:Acrobot-v1/reward-flip:envs=1/oracle/auc_minus_ppo -->+133
    [+21, +246]<!-- /fig --> auc over tuned PPO

The key before the first ``:`` names a file of docs/data: ``<stem>.txt`` holds ``name: value``
lines (a benchmark's summary lines), ``<stem>.csv`` a published compare summary whose figures are
named ``env/method/column`` (the column's value, then its ``_lo`` and ``_hi`` where they exist). The
numbers written between the markers must be, in order, numbers of the value (a subsequence), each
equal to it at the precision written: ``+133 [+21, +246]`` matches ``+133.07 [+20.52, +245.62] (n=10)``.

In the checked regions (the whole of README.md and docs/index.md, and each results page's short
answer between ``<!-- short-answer -->`` markers), every number of the prose must be inside such
markers or inside a table that ``publish_results.py`` generates; code, link targets and names
such as ``CartPole-v1`` or ``SmolLM2-135M`` are not numbers of the prose.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data"
FIGURE = re.compile(r"<!-- fig:(?P<key>[^ ]+?) -->(?P<text>.*?)<!-- /fig -->", re.S)
NUMBER = re.compile(r"[-+]?(?:\d+\.\d+|\d+|\.\d+|inf)")
# a number of the prose: not part of a name (v1, SB3, 135M, theta(k+1)) or of a longer token
PROSE_NUMBER = re.compile(r"(?<![\w.\-/+])[-+]?\d+(?:\.\d+)?(?![\w.]*[A-Za-z_]|\.\d)")
# tables publish_results.py writes from data; the jobs table is README.md's own prose, copied to docs/index.md
GENERATED = re.compile(r"<!-- table:(?P<name>(?!jobs -->)[\w-]+) -->.*?<!-- /table:(?P=name) -->", re.S)
SHORT_ANSWER = re.compile(r"<!-- short-answer -->(?P<body>.*?)<!-- /short-answer -->", re.S)
CODE = re.compile(r"```.*?```|`[^`]+`", re.S)
LINK_TARGET = re.compile(r"\]\([^)]*\)|<[a-z]+://[^>]*>|https?://\S+")
COMMENT = re.compile(r"<!--.*?-->", re.S)

CHECKED_PAGES = ("README.md", "docs/index.md")
"""Pages whose every prose number must be a checked figure; results pages are checked in their short answer."""
RESULTS_PAGES = "docs/results/*.md"


def numbers(text: str) -> list[float]:
    """The numbers written in ``text``, in order (``+133`` -> 133.0, ``inf`` -> inf)."""
    return [float(n) for n in NUMBER.findall(text.replace("\u2212", "-"))]


def _spaced(key: str) -> str:
    """A key's words apart, so that its numbers read as numbers: ``log_ratio80`` -> ``log ratio 80``."""
    return re.sub(r"(?<=[A-Za-z])(?=\d)", " ", key.replace("_", " "))


def _decimals(token: str) -> int:
    return len(token.split(".")[1]) if "." in token else 0


@cache
def _summary_lines(stem: str) -> dict[str, str]:
    """``name: value`` lines of docs/data/<stem>.txt (inside code fences too)."""
    lines = {}
    for line in (DATA / f"{stem}.txt").read_text().splitlines():
        name, sep, value = line.partition(": ")
        if sep and " " not in name.strip():
            lines[name.strip()] = value.strip()
    return lines


@cache
def _summary_frame(stem: str) -> pd.DataFrame:
    return pd.read_csv(DATA / f"{stem}.csv")


def value(key: str) -> str:
    """The text a figure's key names in docs/data (``KeyError`` naming what is missing)."""
    stem, _, name = key.partition(":")
    if (DATA / f"{stem}.txt").is_file():
        lines = _summary_lines(stem)
        if name not in lines:
            raise KeyError(f"docs/data/{stem}.txt has no line {name!r}")
        return lines[name]
    if (DATA / f"{stem}.csv").is_file():
        env, method, column = name.rsplit("/", 2)
        frame = _summary_frame(stem)
        rows = frame[(frame["env"] == env) & (frame["method"] == method)]
        if len(rows) != 1 or column not in frame:
            raise KeyError(f"docs/data/{stem}.csv has no {column!r} for {env} / {method}")
        row = rows.iloc[0]
        parts = [row[c] for c in (column, f"{column}_lo", f"{column}_hi") if c in frame]
        return " ".join(str(p) for p in parts)
    raise KeyError(f"no docs/data/{stem}.txt or .csv")


def figure_mismatch(key: str, text: str) -> str | None:
    """Why the figure written as ``text`` is not what ``key`` names in the data (None when it is)."""
    try:  # the key's own numbers (within_5) come first: "within 5 rounds in 86/140" is checked whole
        source = [float(x) for x in PROSE_NUMBER.findall(_spaced(key))] + numbers(value(key))
    except KeyError as exc:
        return str(exc.args[0])
    written = NUMBER.findall(text.replace("\u2212", "-"))
    if not written:
        return f"{text!r} quotes no number"
    i = 0
    for token in written:
        digits = _decimals(token)
        while i < len(source) and not _same(float(token), source[i], digits):
            i += 1
        if i == len(source):
            return f"{text!r} is not {value(key)!r} ({key})"
        i += 1
    return None


def _same(written: float, source: float, digits: int) -> bool:
    if source in (float("inf"), float("-inf")):
        return written == source
    return abs(written - round(source, digits)) <= 0.5 * 10 ** -digits + 1e-9 * abs(source)


def unchecked_numbers(text: str) -> list[str]:
    """The numbers of ``text``'s prose outside figure markers, generated tables, code and link targets."""
    for pattern in (GENERATED, FIGURE, CODE, LINK_TARGET, COMMENT):
        text = pattern.sub(" ", text)
    text = re.sub(r"^#+ .*$", " ", text, flags=re.M)  # headings name things, they quote nothing
    return PROSE_NUMBER.findall(text)


def check_text(text: str, where: str, whole: bool) -> list[str]:
    """Problems of one page: a figure that disagrees with its data, and (in its checked regions: the
    whole page, or its short answer) a number written without its source."""
    problems = [f"{where}: {why}" for m in FIGURE.finditer(text)
                if (why := figure_mismatch(m["key"], m["text"])) is not None]
    regions = [text] if whole else [m["body"] for m in SHORT_ANSWER.finditer(text)]
    for region in regions:
        loose = unchecked_numbers(region)
        if loose:
            problems.append(f"{where}: numbers without a source in data: {', '.join(loose[:12])}"
                            f"{' ...' if len(loose) > 12 else ''}")
    return problems


def check_pages() -> list[str]:
    """Every figure problem of README.md, docs/index.md and the results pages."""
    problems = []
    for page in CHECKED_PAGES:
        problems += check_text((ROOT / page).read_text(), page, whole=True)
    for page in sorted(ROOT.glob(RESULTS_PAGES)):
        problems += check_text(page.read_text(), str(page.relative_to(ROOT)), whole=False)
    return problems
