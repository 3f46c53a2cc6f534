"""The one exception type for bad input a user can fix (the CLI prints it as one line, exit 2)."""


class UserError(ValueError):
    """Bad input: an unknown env id, an invalid hyperparameter, an unusable file or directory."""
