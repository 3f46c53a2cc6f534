"""mkdocs hook: the command-line reference page is generated from the parsers at build time.

``docs/cli.md`` holds a ``<!-- cli-reference -->`` marker; it is replaced by every command's
``--help`` (``rlinfluence.cli.COMMANDS``, in order), so the page cannot drift from the code.
"""

from __future__ import annotations

import contextlib
import io
import os

MARKER = "<!-- cli-reference -->"


def _help(args: list[str]) -> str:
    from rlinfluence import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.main([*args, "--help"])
    return out.getvalue().rstrip()


def cli_reference() -> str:
    from rlinfluence import cli

    os.environ["COLUMNS"] = "100"  # the width tyro wraps the help to
    parts = ["```text", _help([]), "```"]
    for name, (_, _, summary) in cli.COMMANDS.items():
        parts += ["", f"## rlinfluence {name}", "", summary[0].upper() + summary[1:] + ".", "", "```text",
                  _help([name]), "```"]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 - mkdocs' hook signature
    return markdown.replace(MARKER, cli_reference()) if MARKER in markdown else markdown
