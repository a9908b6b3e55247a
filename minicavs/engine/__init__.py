"""The engine: F and ∂F compiled to templates, bound to a batch, run by a device's runner; the seam
(backend.py) the devices implement."""
