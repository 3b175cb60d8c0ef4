"""The checkpoint error type, in a module of its own so that the low-level readers (shards.py,
readahead.py) and the loader that uses them can all raise it without importing each other."""


class CheckpointError(ValueError):
    """A model directory that cannot be loaded; the message names the file or tensor."""
