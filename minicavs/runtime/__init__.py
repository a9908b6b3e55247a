"""The vertex runtime: vertex functions, input graphs, batching policies (tasks) and the memory plan of
dynamic tensors."""
