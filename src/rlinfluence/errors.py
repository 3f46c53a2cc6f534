"""The one exception type for bad input a user can fix (the CLI prints it as one line, exit 2)."""


class UserError(ValueError):
    """Bad input: an unknown env id, an invalid hyperparameter, an unusable file or directory."""


def require_module(module: str, extra: str) -> None:
    """Raise ``UserError`` naming the extra to install if ``module`` (an optional dependency) is missing."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise UserError(f"this needs the optional package {module!r}: pip install 'rlinfluence[{extra}]'")
