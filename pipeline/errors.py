"""The one exception type for mistakes a user can fix (printed as one line, exit code 2)."""


class UserError(Exception):
    """Something the user can fix: bad input, bad config, missing artefact. Message = what, expected, fix."""
