"""The lattice LSTM (models/lattice_lstm.py, ED-Batch's LatticeLSTM) in DyNet 2.2 with autobatching, for the
peers' harness.

Same function as the model without dropout (its fused cells), written per lattice as a DyNet user writes
it, char by char (Zhang & Yang 2018's equations): each char's gates [i, f, o, u] = W_c·x + U_c·h_p + b_c
from the previous char's (h_p, c_p) (zeros before the first). Where no lexicon word ends, c = σ(f)⊙c_p +
σ(i)⊙tanh(u). Where words end, each word cell (word over chars b..e, from char b's (h_b, c_b)) is
[i, f, u] = W_w·x_w + U_w·h_b + b_w, c_w = σ(f)⊙c_b + σ(i)⊙tanh(u), and the char's c is the normalised
mix (a_0⊙tanh(u) + Σ_k a_k⊙c_k) / (a_0 + Σ_k a_k) with a_0 = exp(σ(i)), a_k = exp(σ(W_g·x + U_g·c_k + b_g)).
Every char: h = σ(o)⊙tanh(c), softmax(W_o·h + b_o) tags it; loss = summed cross-entropy / lattices.
minicavs' weights (rows @ W) are transposed for DyNet's W·x.

Runs in DyNet's own environment (tools/setup_peers.sh) and imports nothing from minicavs. Input: one JSON
spec with the lattices (as tools/dynet_lattice_gru.py's) naming an .npz of weights; output: one JSON line
(the protocol of minicavs/bench/peers.py; units are lattices; DyNet settings and optimizer:
tools/dynet_peer.py).

    python tools/dynet_lattice_lstm.py SPEC.json
"""
import numpy as np
from dynet_peer import check_loss, start, train_and_report
from peer_common import read_spec


def main():
    spec = read_spec()
    dy = start(spec)
    w = np.load(spec["weights"])
    H = w["U_g"].shape[0]
    pc = dy.ParameterCollection()
    E_c, E_w = pc.lookup_parameters_from_numpy(w["E_c"]), pc.lookup_parameters_from_numpy(w["E_w"])
    P = {k: pc.parameters_from_numpy(np.ascontiguousarray(w[k].T) if w[k].ndim == 2 else w[k])
         for k in w.files if k not in ("E_c", "E_w")}   # matrices transposed, biases as they are

    def gate(g, k):
        return dy.pick_range(g, k * H, (k + 1) * H)

    def word_cell(wid, h_b, c_b):
        g = dy.affine_transform([P["b_w"], P["W_w"], dy.lookup(E_w, wid), P["U_w"], h_b])
        return dy.cmult(dy.logistic(gate(g, 1)), c_b) + dy.cmult(dy.logistic(gate(g, 0)), dy.tanh(gate(g, 2)))

    def char_cell(x, h_p, c_p, words):
        g = dy.affine_transform([P["b_c"], P["W_c"], x, P["U_c"], h_p])
        i, f, o, u = (gate(g, k) for k in range(4))
        if not words:
            c = dy.cmult(dy.logistic(f), c_p) + dy.cmult(dy.logistic(i), dy.tanh(u))
        else:
            xg = dy.affine_transform([P["b_g"], P["W_g"], x])
            a = [dy.exp(dy.logistic(i))] + [dy.exp(dy.logistic(xg + P["U_g"] * c_k)) for c_k in words]
            c = dy.cdiv(dy.esum([dy.cmult(a[0], dy.tanh(u))] + [dy.cmult(a_k, c_k) for a_k, c_k in
                                                                 zip(a[1:], words)]), dy.esum(a))
        return dy.cmult(dy.logistic(o), dy.tanh(c)), c

    def lattice_loss(lat):
        h, c, states, losses = dy.zeros(H), dy.zeros(H), [], []
        for e, (ch, label) in enumerate(zip(lat["chars"], lat["labels"])):
            words = [word_cell(wid, *states[b]) for b, end, wid in lat["words"] if end == e]
            h, c = char_cell(dy.lookup(E_c, ch), h, c, words)
            states.append((h, c))
            losses.append(dy.pickneglogsoftmax(dy.affine_transform([P["b_o"], P["W_o"], h]), label))
        return dy.esum(losses)

    def batch_loss(batch):
        return dy.esum([lattice_loss(lat) for lat in batch]) / len(batch)

    lattices = spec["lattices"]
    check = check_loss(dy, batch_loss, lattices[:spec["check"]])
    train_and_report(dy, pc, batch_loss, lattices, [1] * len(lattices), spec, check)


if __name__ == "__main__":
    main()
