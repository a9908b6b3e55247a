"""Parameters and initializers (losses are ops: see :mod:`minicavs.ops.nn`)."""
from . import init  # noqa: F401
from .init import get_initializer  # noqa: F401
from .parameter import Parameter, ParameterSet  # noqa: F401
