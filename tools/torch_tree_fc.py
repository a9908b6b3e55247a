"""The bench's Tree-FC in PyTorch (CPU), hand-batched by level, for `minicavs bench --torch-python`.

Every tree of a batch is the same complete binary tree, so each level is one matmul over all its vertices:
leaves h = tanh(x·W_l + b_l); a level's parents take [h_left; h_right] of consecutive children, which is a
view of the level below; the root's r = h·w_o + b_o; loss = sum of (r - y)^2 / trees. Runs in its own
environment (tools/setup_peers.sh) and imports nothing from minicavs. Input: one JSON spec naming an .npz of
weights (rows @ W, as minicavs stores them) and an .npz of data; output: one JSON line with the loss of the
first trees for the given weights (no update) and trees/s of each timed epoch (forward, backward, Adam).

    python tools/torch_tree_fc.py SPEC.json
"""
import json
import sys

import numpy as np
from torch_peer import train_and_report


def main(path):
    import torch
    spec = json.load(open(path))
    torch.set_num_threads(spec.get("threads", 2))
    w = np.load(spec["weights"])
    data = np.load(spec["data"])
    P = {k: torch.nn.Parameter(torch.from_numpy(np.array(w[k]))) for k in ("W_l", "b_l", "W", "b", "w_o", "b_o")}
    xs, ys = torch.from_numpy(data["xs"]), torch.from_numpy(data["ys"])

    def loss_fn(x, y):
        B, L, H = x.shape
        h = torch.tanh(x.reshape(B * L, H) @ P["W_l"] + P["b_l"])
        while h.shape[0] > B:
            h = torch.tanh(h.reshape(-1, 2 * H) @ P["W"] + P["b"])   # siblings side by side
        r = (h @ P["w_o"] + P["b_o"]).reshape(B)
        return ((r - y) ** 2).sum() / B

    k = spec["check_trees"]
    with torch.no_grad():
        check_loss = float(loss_fn(xs[:k], ys[:k]))
    bs = spec["batch"]
    batches = [(xs[i:i + bs], ys[i:i + bs]) for i in range(0, len(xs), bs)]
    train_and_report(torch, P.values(), loss_fn, batches, len(xs), spec, check_loss)


if __name__ == "__main__":
    main(sys.argv[1])
