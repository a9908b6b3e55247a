"""Graph passes over F and ∂F (§3.4): classification now; fusion grouping later."""
