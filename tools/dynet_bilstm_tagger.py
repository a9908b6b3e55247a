"""The BiLSTM tagger (models/bilstm_tagger.py) in DyNet 2.2 with autobatching, for the peers' harness.

Same function as the model without dropout, written per sentence as a DyNet user writes it: two
``VanillaLSTMBuilder``s (built with forget_bias=0, gates i, f, o, g: minicavs' order and equations, so
minicavs' W_d, U_d (transposed) and b_d become their parameters unchanged), one transducing the sentence's
embedded words left to right, the other right to left; word t's scores W_of·hf_t + W_ob·hb_t + b_o and the
negative log-likelihood of its tag; loss = summed cross-entropy / sentences.

Runs in DyNet's own environment (tools/setup_peers.sh) and imports nothing from minicavs. Input: one JSON
spec naming an .npz of weights (minicavs' names and layout, rows @ W) and an .npz of data (``inputs``: the
words, ``targets``: the tags of all sentences concatenated, ``ptr``: sentence offsets); output: one JSON
line (the protocol of minicavs/bench/peers.py; units are words; DyNet settings and optimizer:
tools/dynet_peer.py).

    python tools/dynet_bilstm_tagger.py SPEC.json
"""
import numpy as np
from dynet_peer import check_loss, lstm_builder, start, train_and_report
from peer_common import read_spec


def main():
    spec = read_spec()
    dy = start(spec)
    w = np.load(spec["weights"])
    data = np.load(spec["data"])
    ptr = data["ptr"]
    samples = [(data["inputs"][a:b].tolist(), data["targets"][a:b].tolist()) for a, b in zip(ptr[:-1], ptr[1:])]
    pc = dy.ParameterCollection()
    E = pc.lookup_parameters_from_numpy(w["E"])
    fwd, bwd = (lstm_builder(dy, pc, w[f"W_{d}"], w[f"U_{d}"], w[f"b_{d}"]) for d in "fb")
    W_of, W_ob = (pc.parameters_from_numpy(np.ascontiguousarray(w[k].T)) for k in ("W_of", "W_ob"))
    b_o = pc.parameters_from_numpy(w["b_o"])

    def sample_loss(words, tags):
        xs = [dy.lookup(E, i) for i in words]
        hf = fwd.initial_state().transduce(xs)
        hb = bwd.initial_state().transduce(xs[::-1])[::-1]
        return dy.esum([dy.pickneglogsoftmax(dy.affine_transform([b_o, W_of, f, W_ob, b]), y)
                        for f, b, y in zip(hf, hb, tags)])

    def batch_loss(batch):
        return dy.esum([sample_loss(x, y) for x, y in batch]) / len(batch)

    check = check_loss(dy, batch_loss, samples[:spec["check"]])
    train_and_report(dy, pc, batch_loss, samples, [len(y) for _, y in samples], spec, check)


if __name__ == "__main__":
    main()
