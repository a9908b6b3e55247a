"""The lattice GRU (models/lattice_gru.py) in DyNet 2.2 with autobatching, for the peers' harness.

Same function as the model without dropout, written per lattice as a DyNet user writes it, char by char:
a GRU step over each char from the previous char's state (zeros before the first); where lexicon words end,
each word cell is a GRU step (the word weights) from the state of the char where its word starts, and the
char's state is the sum of its own update and the word cells' states weighted by exp(σ(W_g·x + U_g·h + b_g)),
normalised; softmax(W_o·h + b_o) tags every char; loss = summed cross-entropy / lattices. A GRU step, with
minicavs' W (D, 3H), U (H, 2H), U_n (H, H) transposed for DyNet's W·x: [z, r, n_x] = W·x + b,
[z_h, r_h] = U·h, z = σ(z + z_h), r = σ(r + r_h), n = tanh(n_x + U_n·(r ⊙ h)), h' = h + z ⊙ (n - h).

Runs in DyNet's own environment (tools/setup_peers.sh) and imports nothing from minicavs. Input: one JSON
spec with the lattices (``chars``, ``words`` as [start, end, word id], ``labels``) naming an .npz of weights
(minicavs' names, rows @ W); output: one JSON line (the protocol of minicavs/bench/peers.py; units are
lattices; DyNet settings and optimizer: tools/dynet_peer.py).

    python tools/dynet_lattice_gru.py SPEC.json
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
    P = {k: pc.parameters_from_numpy(np.ascontiguousarray(w[k].T))
         for k in ("W_c", "U_c", "U_cn", "W_w", "U_w", "U_wn", "W_g", "U_g", "W_o")}
    B = {k: pc.parameters_from_numpy(w[k]) for k in ("b_c", "b_w", "b_g", "b_o")}

    def gru(pre, x, h):
        g, gh = dy.affine_transform([B[f"b_{pre}"], P[f"W_{pre}"], x]), P[f"U_{pre}"] * h
        z = dy.logistic(dy.pickrange(g, 0, H) + dy.pickrange(gh, 0, H))
        r = dy.logistic(dy.pickrange(g, H, 2 * H) + dy.pickrange(gh, H, 2 * H))
        n = dy.tanh(dy.pickrange(g, 2 * H, 3 * H) + P[f"U_{pre}n"] * dy.cmult(r, h))
        return h + dy.cmult(z, n - h)

    def lattice_loss(lat):
        h, states, losses = dy.zeros(H), [], []
        for e, (ch, label) in enumerate(zip(lat["chars"], lat["labels"])):
            x = dy.lookup(E_c, ch)
            h = gru("c", x, h)
            cells = [h] + [gru("w", dy.lookup(E_w, wid), states[b]) for b, end, wid in lat["words"] if end == e]
            if len(cells) > 1:
                xg = dy.affine_transform([B["b_g"], P["W_g"], x])
                a = [dy.exp(dy.logistic(xg + P["U_g"] * c)) for c in cells]
                h = dy.cdiv(dy.esum([dy.cmult(ak, c) for ak, c in zip(a, cells)]), dy.esum(a))
            states.append(h)
            losses.append(dy.pickneglogsoftmax(dy.affine_transform([B["b_o"], P["W_o"], h]), label))
        return dy.esum(losses)

    def batch_loss(batch):
        return dy.esum([lattice_loss(lat) for lat in batch]) / len(batch)

    lattices = spec["lattices"]
    check = check_loss(dy, batch_loss, lattices[:spec["check"]])
    train_and_report(dy, pc, batch_loss, lattices, [1] * len(lattices), spec, check)


if __name__ == "__main__":
    main()
