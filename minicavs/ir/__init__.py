"""The IR as plain data: nodes and graphs (``graph.py``). It imports nothing of ``minicavs.ops``: the ops build
nodes, and everything that needs the op registry (autodiff, control flow, bodies, serialization) lives there."""
