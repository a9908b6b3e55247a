"""The bench's Tree-FC in PyTorch (CPU), hand-batched by level, for `minicavs bench --torch-python`.

Same function as models/tree_fc.py. Every tree of a batch is the same complete binary tree, so each level is
one matmul over (trees x vertices of the level) rows: leaves h = tanh(x·W_l + b_l); a level's parents take
[h_left; h_right] of consecutive children, which is a view (reshape) of the level below; the root's
r = h·w_o + b_o; loss = summed (r - y)^2 / trees. Runs in its own environment (tools/setup_peers.sh) and
imports nothing from minicavs.

Input: one JSON spec naming an .npz of weights (rows @ W, as minicavs stores them: W_l, b_l, W, b, w_o, b_o)
and an .npz of data (xs: trees x leaves x H in minicavs' leaf order, ys: trees), with batch, epochs,
check_trees, threads and optimizer (tools/torch_peer.py). Output: one JSON line with the loss of the first
check_trees trees for the given weights (no update) and trees/s of each timed epoch after a warm-up epoch
(forward, backward, update).

    python tools/torch_tree_fc.py SPEC.json
"""
import json
import sys

import numpy as np
from torch_peer import set_threads, train_and_report


def main(path):
    import torch
    spec = json.load(open(path))
    set_threads(torch, spec)
    w = np.load(spec["weights"])
    data = np.load(spec["data"])
    P = {k: torch.nn.Parameter(torch.from_numpy(np.array(w[k]))) for k in ("W_l", "b_l", "W", "b", "w_o", "b_o")}
    xs, ys = torch.from_numpy(data["xs"]), torch.from_numpy(data["ys"])

    def loss_fn(x, y):
        B, L, H = x.shape
        h = torch.tanh(torch.addmm(P["b_l"], x.reshape(B * L, H), P["W_l"]))
        while h.shape[0] > B:
            h = torch.tanh(torch.addmm(P["b"], h.reshape(-1, 2 * H), P["W"]))   # siblings side by side
        r = torch.addmm(P["b_o"], h, P["w_o"]).reshape(B)
        return ((r - y) ** 2).sum() / B

    k = spec["check_trees"]
    with torch.no_grad():
        check_loss = float(loss_fn(xs[:k], ys[:k]))
    bs = spec["batch"]
    batches = [(xs[i:i + bs], ys[i:i + bs]) for i in range(0, len(xs), bs)]
    train_and_report(torch, P.values(), loss_fn, batches, len(xs), spec, check_loss)


if __name__ == "__main__":
    main(sys.argv[1])
