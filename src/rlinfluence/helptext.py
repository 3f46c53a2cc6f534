"""Markers for the command line's help text (``Annotated[T, marker]`` on a config field).

tyro ends every flag's help with ``(default: X)``. Two cases read badly: a field whose docstring
already says what its default means (``(default: the last saved round) (default: None)``), and an
empty tuple (``(default: )``). ``StatedDefault`` drops tyro's hint; ``EmptyMeansNone`` writes an
empty default as ``(default: none)``.
"""

from __future__ import annotations

import tyro

StatedDefault = tyro.conf.arg(help_behavior_hint="")
"""the field's docstring states its default"""
EmptyMeansNone = tyro.conf.arg(help_behavior_hint=lambda label: f"(default: {label or 'none'})")
"""an empty default is shown as ``none``"""
RunName = tyro.conf.arg(metavar="RUN")
"""a positional run directory is shown as ``RUN`` (tyro would write its type, ``STR``)"""
RunNames = tyro.conf.arg(metavar="RUN ...")
"""positional run directories, ``RUN ...``"""


def shown_as(metavar: str) -> object:
    """An optional flag's value shown as ``metavar`` in the help (tyro would write ``{None}|FLOAT``);
    left out, the flag is None, as its ``(default: None)`` says."""
    return tyro.conf.arg(metavar=metavar)
