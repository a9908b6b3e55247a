"""The IR: nodes and graphs as plain data, reverse-mode autodiff over them, control flow as operators (the op
registry beside it, in ``minicavs.ops``)."""
