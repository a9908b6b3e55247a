"""Graph passes over F and ∂F: classification into phases (§3.4, classify.py), fusion of elementwise nodes
(fusion.py), placement of values in dynamic tensors and concat blocks (alias.py), merging of products that
share an operand (gemm.py)."""
