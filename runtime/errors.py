"""The one exception type for user mistakes: the CLI prints its message on one line and exits 2."""


class UserError(Exception):
    """A mistake the user can fix; the message names the fix."""
