"""User-facing errors: reported as one line with a non-zero exit, never a traceback."""


class UserError(Exception):
    """A problem with the user's input (config, files, arguments), not a bug in lmforge.

    The CLI prints ``error: <message>`` on one line and exits with status 2.
    """
