"""Code generation for fused elementwise groups: pure strings (no compiler or cupy imported here)."""
