"""The one error type that reaches the user as a message rather than a traceback."""


class UserError(Exception):
    """Bad input from the user: the CLI prints the message on one line and exits with code 1.

    The message must say what is wrong and how to fix it.
    """
