"""The Tree-GRU (models/tree_gru.py, ED-Batch's TreeGRU) in DyNet 2.2 with autobatching, for the peers' harness.

Same function as the model without dropout, written per vertex as a DyNet user writes it: leaf
h = tanh(W·x + b_l); internal [z, r1, r2] = σ(U_g·[h1; h2] + b_g), u = tanh(U_u·[r1⊙h1; r2⊙h2] + b_u),
h = z⊙(h1 + h2)/2 + (1 - z)⊙u; softmax(W_o·h + b_o) at every vertex; loss = summed cross-entropy / trees.
minicavs' weights (rows @ W) are transposed for DyNet's W·x.

Runs in DyNet's own environment (tools/setup_peers.sh) and imports nothing from minicavs. Input: one JSON
spec with the trees (as tools/dynet_tree_lstm.py's) naming an .npz of weights; output: one JSON line (the
protocol of minicavs/bench/peers.py; units are trees; DyNet settings and optimizer: tools/dynet_peer.py).

    python tools/dynet_tree_gru.py SPEC.json
"""
import numpy as np
from dynet_peer import check_loss, start, train_and_report
from peer_common import read_spec


def main():
    spec = read_spec()
    dy = start(spec)
    w = np.load(spec["weights"])
    H = w["W_o"].shape[0]
    pc = dy.ParameterCollection()
    E = pc.lookup_parameters_from_numpy(w["E"])
    P = {k: pc.parameters_from_numpy(np.ascontiguousarray(w[k].T) if w[k].ndim == 2 else w[k])
         for k in w.files if k != "E"}   # matrices transposed, biases as they are
    trees = spec["trees"]

    def vertex(v, ch, words, state):
        if not ch:
            return dy.tanh(dy.affine_transform([P["b_l"], P["W"], dy.lookup(E, words[str(v)])]))
        h1, h2 = state[ch[0]], state[ch[1]]
        g = dy.logistic(dy.affine_transform([P["b_g"], P["U_g"], dy.concatenate([h1, h2])]))
        z, r1, r2 = (dy.pick_range(g, k * H, (k + 1) * H) for k in range(3))
        u = dy.tanh(dy.affine_transform([P["b_u"], P["U_u"], dy.concatenate([dy.cmult(r1, h1), dy.cmult(r2, h2)])]))
        return u + dy.cmult(z, (h1 + h2) * 0.5 - u)   # = z⊙(h1 + h2)/2 + (1 - z)⊙u

    def tree_loss(t):
        state, losses = {}, []
        for v, ch in enumerate(t["children"]):  # children come before parents
            state[v] = h = vertex(v, ch, t["words"], state)
            losses.append(dy.pickneglogsoftmax(dy.affine_transform([P["b_o"], P["W_o"], h]), t["labels"][v]))
        return dy.esum(losses)

    def batch_loss(batch):
        return dy.esum([tree_loss(t) for t in batch]) / len(batch)

    check = check_loss(dy, batch_loss, trees[:spec["check"]])
    train_and_report(dy, pc, batch_loss, trees, [1] * len(trees), spec, check)


if __name__ == "__main__":
    main()
