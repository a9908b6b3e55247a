"""minicavs: a from-scratch implementation of Cavs, the vertex-centric runtime for dynamic neural networks."""
from . import ops  # noqa: F401  (registers every op)
from . import cpu  # noqa: F401  (the default backend: provides the C kernels the ops and optimizers use)
from .autodiff import grad  # noqa: F401
from .dtypes import float32, float64, int32, int64  # noqa: F401
from .errors import CheckpointError, FeedError, MinicavsError, NonFiniteError, ShapeError  # noqa: F401
from .executor import Executor, RunContext, run  # noqa: F401
from .graph import Graph, Node  # noqa: F401

__version__ = "0.1.0"
