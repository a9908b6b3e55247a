"""The MV-RNN (models/mv_rnn.py, ED-Batch's MV-RNN) in DyNet 2.2 with autobatching, for the peers' harness.

Same function as the model without dropout, written per vertex as a DyNet user writes it: every vertex
holds a vector and an H x H matrix. Leaf (word w): a = E[w][:H], A = I + M with M = E[w][H:] read row by
row (minicavs' layout; DyNet's reshape reads columns, hence the transpose). Internal, children (a, A) and
(b, B): p = tanh(W·[B·a; A·b] + b_W), P = W_M·[A; B] (the matrices stacked by rows); softmax(W_o·p + b_o)
at every vertex (a leaf's p is its a); loss = summed cross-entropy / trees. minicavs' weights (rows @ W)
are transposed for DyNet's W·x, except W_M, which minicavs already applies from the left.

Runs in DyNet's own environment (tools/setup_peers.sh) and imports nothing from minicavs. Input: one JSON
spec with the trees (as tools/dynet_tree_lstm.py's) naming an .npz of weights; output: one JSON line (the
protocol of minicavs/bench/peers.py; units are trees; DyNet settings and optimizer: tools/dynet_peer.py).

    python tools/dynet_mv_rnn.py SPEC.json
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
    P = {k: pc.parameters_from_numpy(np.ascontiguousarray(w[k].T)) for k in ("W", "W_o")}
    P.update({k: pc.parameters_from_numpy(w[k]) for k in ("W_M", "b_W", "b_o")})
    trees = spec["trees"]

    def vertex(v, ch, words, state):
        """(vector, matrix) of vertex v."""
        if not ch:
            e = dy.lookup(E, words[str(v)])
            M = dy.transpose(dy.reshape(dy.pick_range(e, H, H + H * H), (H, H)))
            return dy.pick_range(e, 0, H), dy.inputTensor(np.eye(H)) + M
        (a, A), (b, B) = state[ch[0]], state[ch[1]]
        p = dy.tanh(dy.affine_transform([P["b_W"], P["W"], dy.concatenate([B * a, A * b])]))
        return p, P["W_M"] * dy.concatenate([A, B])

    def tree_loss(t):
        state, losses = {}, []
        for v, ch in enumerate(t["children"]):  # children come before parents
            state[v] = vertex(v, ch, t["words"], state)
            losses.append(dy.pickneglogsoftmax(dy.affine_transform([P["b_o"], P["W_o"], state[v][0]]),
                                               t["labels"][v]))
        return dy.esum(losses)

    def batch_loss(batch):
        return dy.esum([tree_loss(t) for t in batch]) / len(batch)

    check = check_loss(dy, batch_loss, trees[:spec["check"]])
    train_and_report(dy, pc, batch_loss, trees, [1] * len(trees), spec, check)


if __name__ == "__main__":
    main()
