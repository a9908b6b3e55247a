"""Exceptions users can catch; every message names the op, node, sample or file at fault."""


class MinicavsError(Exception):
    """Base class of the errors minicavs raises on bad input."""


class ShapeError(MinicavsError, ValueError):
    """Shapes or dtypes that do not fit an op, found at declaration time."""


class FeedError(MinicavsError, ValueError):
    """A missing, misshaped or mistyped value given to the executor."""


class NonFiniteError(MinicavsError, FloatingPointError):
    """A NaN or Inf loss or gradient; raised before any parameter changes."""


class CheckpointError(MinicavsError, ValueError):
    """A checkpoint that is missing, corrupt, or does not match the model."""


class InputGraphError(MinicavsError, ValueError):
    """A malformed input graph: cycles, child indices out of range, too many children, empty graphs."""


class DataError(MinicavsError, ValueError):
    """Malformed data: the message names the file and line."""


class RunDirError(MinicavsError):
    """A run directory that cannot be used as asked: it holds another run, has nothing to resume, or is
    not writable."""


class CheckError(RuntimeError):
    """A runner's check caught an instruction of a batch program addressing outside its buffer (or naming no
    register or buffer): raised instead of reading or writing elsewhere."""
