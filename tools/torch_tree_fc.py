"""The bench's Tree-FC in PyTorch (CPU, or the spec's ``device``), two ways, for `minicavs bench --torch-python`:

- ``recursive``: one tree at a time, a recursive function over the tree's vertices, as a user would write
  it (the paper's PyTorch baseline);
- ``level``: hand-batched by level. Every tree of a batch is the same complete binary tree, so each level is
  one matmul over (trees x vertices of the level) rows; a level's parents take [h_left; h_right] of
  consecutive children, which is a view (reshape) of the level below.

Same function as models/tree_fc.py: leaves h = tanh(x·W_l + b_l); internal h = tanh([h_left; h_right]·W + b);
the root's r = h·w_o + b_o; loss = summed (r - y)^2 / trees. Runs in its own environment
(tools/setup_peers.sh) and imports nothing from minicavs.

Input: one JSON spec with the tree (``children`` lists in minicavs' vertex order: leaves 0..L-1 left to
right, then parents level by level, the root last; leaf k reads row k of its tree's inputs), naming an .npz
of weights (rows @ W, as minicavs stores them: W_l, b_l, W, b, w_o, b_o) and an .npz of data (xs: trees x
leaves x H, ys: trees). Output: one JSON line (the protocol of minicavs/bench/peers.py; units are trees;
optimizer: tools/torch_peer.py).

    python tools/torch_tree_fc.py SPEC.json
"""
import numpy as np
from peer_common import read_spec
from torch_peer import check_loss, device, set_threads, train_and_report


def level_layout(leaves: int) -> list:
    """The children lists ``level`` mode assumes (minicavs' complete binary tree)."""
    children, level = [[] for _ in range(leaves)], list(range(leaves))
    while len(level) > 1:
        parents = []
        for i in range(0, len(level), 2):
            children.append([level[i], level[i + 1]])
            parents.append(len(children) - 1)
        level = parents
    return children


def main():
    import torch
    spec = read_spec()
    set_threads(torch, spec)
    dev = device(torch, spec)
    w = np.load(spec["weights"])
    data = np.load(spec["data"])
    P = {k: torch.nn.Parameter(torch.from_numpy(np.array(w[k])).to(dev))
         for k in ("W_l", "b_l", "W", "b", "w_o", "b_o")}
    xs, ys = torch.from_numpy(data["xs"]).to(dev), torch.from_numpy(data["ys"]).to(dev)
    children = spec["children"]
    leaf_row = {v: k for k, v in enumerate(v for v, ch in enumerate(children) if not ch)}
    root = len(children) - 1

    def level_loss(x, y):
        B, L, H = x.shape
        h = torch.tanh(torch.addmm(P["b_l"], x.reshape(B * L, H), P["W_l"]))
        while h.shape[0] > B:
            h = torch.tanh(torch.addmm(P["b"], h.reshape(-1, 2 * H), P["W"]))   # siblings side by side
        r = torch.addmm(P["b_o"], h, P["w_o"]).reshape(B)
        return ((r - y) ** 2).sum() / B

    def encode(v, x):   # h of vertex v in the tree whose leaf inputs are x
        a = children[v]
        if not a:
            return torch.tanh(x[leaf_row[v]] @ P["W_l"] + P["b_l"])
        return torch.tanh(torch.cat([encode(a[0], x), encode(a[1], x)]) @ P["W"] + P["b"])

    def recursive_loss(x, y):
        total = 0.0
        for xk, yk in zip(x, y):
            r = encode(root, xk) @ P["w_o"] + P["b_o"]
            total = total + ((r - yk) ** 2).sum()
        return total / len(x)

    if spec["mode"] == "level":
        if children != level_layout(xs.shape[1]):
            raise ValueError("level mode needs minicavs' complete binary tree layout (leaves first, siblings "
                             "consecutive, parents level by level)")
        loss_fn = level_loss
    elif spec["mode"] == "recursive":
        loss_fn = recursive_loss
    else:
        raise ValueError(f"mode {spec['mode']!r}: torch_tree_fc.py runs 'recursive' or 'level'")
    k = spec["check"]
    check = check_loss(torch, loss_fn, xs[:k], ys[:k])
    train_and_report(torch, P.values(), loss_fn, lambda i, j: (xs[i:j], ys[i:j]), [1] * len(xs), spec, check)


if __name__ == "__main__":
    main()
