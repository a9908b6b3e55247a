"""The bench's Tree-FC in DyNet 2.2 with autobatching, for `minicavs bench --dynet-python`.

Same function as models/tree_fc.py, written per vertex as a DyNet user writes it: leaves
h = tanh(W_l·x + b_l); internal h = tanh(W·[h_left; h_right] + b); the root's r = w_o·h + b_o;
loss = summed (r - y)^2 / trees. minicavs' weights (rows @ W) are transposed for DyNet's W·x. A tree's
inputs enter as one input tensor (leaves x H) from which each leaf picks its row.

Runs in DyNet's own environment (tools/setup_peers.sh) and imports nothing from minicavs. Input: one JSON
spec with the tree (``children`` lists in minicavs' vertex order, children before parents, the root last;
the k-th leaf in vertex order reads row k of its tree's inputs) naming an .npz of weights (W_l, b_l, W, b,
w_o, b_o) and an .npz of data (xs: trees x leaves x H, ys: trees); output: one JSON line (the protocol of
minicavs/bench/peers.py; units are trees; DyNet settings and optimizer: tools/dynet_peer.py).

    python tools/dynet_tree_fc.py SPEC.json
"""
import numpy as np
from dynet_peer import check_loss, start, train_and_report
from peer_common import read_spec


def main():
    spec = read_spec()
    dy = start(spec)
    w = np.load(spec["weights"])
    data = np.load(spec["data"])
    xs, ys = data["xs"], data["ys"]
    pc = dy.ParameterCollection()
    P = {k: pc.parameters_from_numpy(np.ascontiguousarray(w[k].T)) for k in ("W_l", "W", "w_o")}
    B = {k: pc.parameters_from_numpy(w[k]) for k in ("b_l", "b", "b_o")}
    children = spec["children"]
    leaf_row = {v: k for k, v in enumerate(v for v, ch in enumerate(children) if not ch)}

    def tree_loss(k):
        x = dy.inputTensor(xs[k])
        h = {}
        for v, ch in enumerate(children):   # children come before parents
            if not ch:
                h[v] = dy.tanh(dy.affine_transform([B["b_l"], P["W_l"], dy.pick(x, leaf_row[v])]))
            else:
                h[v] = dy.tanh(dy.affine_transform([B["b"], P["W"], dy.concatenate([h[ch[0]], h[ch[1]]])]))
        r = dy.affine_transform([B["b_o"], P["w_o"], h[len(children) - 1]])
        return dy.squared_distance(r, dy.inputVector([float(ys[k])]))

    def batch_loss(batch):
        return dy.esum([tree_loss(k) for k in batch]) / len(batch)

    samples = list(range(len(xs)))
    check = check_loss(dy, batch_loss, samples[:spec["check"]])
    train_and_report(dy, pc, batch_loss, samples, [1] * len(samples), spec, check)


if __name__ == "__main__":
    main()
