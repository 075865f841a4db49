"""User-facing errors: reported as one line with a non-zero exit, never a traceback."""


class UserError(Exception):
    """A problem with the user's input (config, files, arguments), not a bug in lmforge.

    The CLI prints ``error: <message>`` on one line and exits with status 2.
    """


class ConfigError(UserError):
    """A config that cannot be read or does not validate (an unknown key, a bad value, a missing or
    malformed TOML file): raised before anything is built, so a caller can tell a bad config from a
    run that failed later."""
