"""The bench's binary Tree-LSTM (and TreeLSTM-2Type) in DyNet 2.2 with autobatching, for the peers' harness.

Same function as models/tree_lstm.py without dropout, written per vertex as a DyNet user writes it (DyNet's
own benchmark model): leaf [i, o, u] = W·x + b_l, c = σ(i)⊙tanh(u); internal [i, o, u] = U·[h1; h2] + b_i,
f_k = σ(U_fk·h_k + b_f), c = σ(i)⊙tanh(u) + f1⊙c1 + f2⊙c2; h = σ(o)⊙tanh(c); softmax(W_o·h + b_o) at every
vertex; loss = summed cross-entropy / trees. minicavs' weights (rows @ W) are transposed for DyNet's W·x.
TreeLSTM-2Type (models/tree_lstm_2type.py): a tree's ``kinds`` name each internal vertex's type, ``cell_a``
or ``cell_b``, whose internal weights are minicavs' ``a.U``, ``a.b_i``, ... and ``b.U``, ... .

Runs in DyNet's own environment (tools/setup_peers.sh) and imports nothing from minicavs. Input: one JSON
spec with the trees (children lists, children before parents; leaf word ids; labels) naming an .npz of
weights; output: one JSON line (the protocol of minicavs/bench/peers.py; units are trees; DyNet settings
and optimizer: tools/dynet_peer.py).

    python tools/dynet_tree_lstm.py SPEC.json
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
    prefix = {"internal": "", "cell_a": "a.", "cell_b": "b."}   # a vertex's kind -> its weights' prefix
    trees = spec["trees"]

    def tree_loss(t):
        children, words, labels = t["children"], t["words"], t["labels"]
        kinds = t.get("kinds") or ["internal"] * len(children)
        state, losses = {}, []
        for v, ch in enumerate(children):  # children come before parents
            if not ch:
                iou = dy.affine_transform([P["b_l"], P["W"], dy.lookup(E, words[str(v)])])
                c = dy.cmult(dy.logistic(dy.pick_range(iou, 0, H)), dy.tanh(dy.pick_range(iou, 2 * H, 3 * H)))
            else:
                (h1, c1), (h2, c2), pre = state[ch[0]], state[ch[1]], prefix[kinds[v]]
                iou = dy.affine_transform([P[pre + "b_i"], P[pre + "U"], dy.concatenate([h1, h2])])
                f1 = dy.logistic(dy.affine_transform([P[pre + "b_f"], P[pre + "U_f1"], h1]))
                f2 = dy.logistic(dy.affine_transform([P[pre + "b_f"], P[pre + "U_f2"], h2]))
                c = (dy.cmult(dy.logistic(dy.pick_range(iou, 0, H)), dy.tanh(dy.pick_range(iou, 2 * H, 3 * H)))
                     + dy.cmult(f1, c1) + dy.cmult(f2, c2))
            h = dy.cmult(dy.logistic(dy.pick_range(iou, H, 2 * H)), dy.tanh(c))
            state[v] = (h, c)
            losses.append(dy.pickneglogsoftmax(dy.affine_transform([P["b_o"], P["W_o"], h]), labels[v]))
        return dy.esum(losses)

    def batch_loss(batch):
        return dy.esum([tree_loss(t) for t in batch]) / len(batch)

    check = check_loss(dy, batch_loss, trees[:spec["check"]])
    train_and_report(dy, pc, batch_loss, trees, [1] * len(trees), spec, check)


if __name__ == "__main__":
    main()
