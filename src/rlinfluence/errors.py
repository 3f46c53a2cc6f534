"""The one exception type for bad input a user can fix (the CLI prints it as one line, exit 2)."""


class UserError(ValueError):
    """Bad input: an unknown env id, an invalid hyperparameter, an unusable file or directory."""


def require_module(module: str, extra: str) -> None:
    """Raise ``UserError`` naming the extra to install if ``module`` (an optional dependency, or the
    submodule of it that is used: ``rliable.library``) is missing or fails to import."""
    import importlib
    import importlib.util

    package = module.split(".")[0]
    if importlib.util.find_spec(package) is None:
        raise UserError(f"this needs the optional package {package!r}: pip install 'rlinfluence[{extra}]'")
    try:  # installed, but it may not import beside the environment's other packages (rliable's arch with pandas 3)
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import-time failure of a third-party package
        raise UserError(f"the optional package {package!r} is installed but fails to import ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}): pip install 'rlinfluence[{extra}]' "
                        "installs the versions it needs") from None
