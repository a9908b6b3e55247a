"""The LSTM encoder-decoder (models/lstm_nmt.py) in DyNet 2.2 with autobatching, for the peers' harness.

Same function as the model (reverse a digit string), written per sequence as a DyNet user writes it: an
encoder ``VanillaLSTMBuilder`` over the source's embeddings from zero state, a decoder one started from the
encoder's final (c, h) and transducing <go> then the reversed source (teacher forcing); at every decoder step
W_o·h + b_o and the negative log-likelihood of the next target token (the reversed source, then <eos>);
loss = summed cross-entropy / sequences. Both builders have forget_bias=0 and gates i, f, o, g (minicavs'
order and equations), so minicavs' enc_Wx, enc_Wh (transposed), enc_b and dec_* become their parameters.

Runs in DyNet's own environment (tools/setup_peers.sh) and imports nothing from minicavs. Input: one JSON
spec (``eos``, ``go``: the two token ids) naming an .npz of weights (minicavs' names, rows @ W) and an .npz
of data (``inputs``: the sources concatenated, ``ptr``: their offsets); output: one JSON line (the protocol
of minicavs/bench/peers.py; units are sequences; DyNet settings and optimizer: tools/dynet_peer.py).

    python tools/dynet_lstm_nmt.py SPEC.json
"""
import numpy as np
from dynet_peer import check_loss, lstm_builder, start, train_and_report
from peer_common import read_spec


def main():
    spec = read_spec()
    dy = start(spec)
    w = np.load(spec["weights"])
    data = np.load(spec["data"])
    ptr, eos, go = data["ptr"], spec["eos"], spec["go"]
    samples = [data["inputs"][a:b].tolist() for a, b in zip(ptr[:-1], ptr[1:])]
    pc = dy.ParameterCollection()
    E = pc.lookup_parameters_from_numpy(w["E"])
    enc, dec = (lstm_builder(dy, pc, w[f"{p}_Wx"], w[f"{p}_Wh"], w[f"{p}_b"]) for p in ("enc", "dec"))
    W_o = pc.parameters_from_numpy(np.ascontiguousarray(w["W_o"].T))
    b_o = pc.parameters_from_numpy(w["b_o"])

    def sample_loss(src):
        final = enc.initial_state().add_inputs([dy.lookup(E, i) for i in src])[-1]
        hs = dec.initial_state(list(final.s())).transduce([dy.lookup(E, i) for i in [go] + src[::-1]])
        return dy.esum([dy.pickneglogsoftmax(dy.affine_transform([b_o, W_o, h]), y)
                        for h, y in zip(hs, src[::-1] + [eos])])

    def batch_loss(batch):
        return dy.esum([sample_loss(x) for x in batch]) / len(batch)

    check = check_loss(dy, batch_loss, samples[:spec["check"]])
    train_and_report(dy, pc, batch_loss, samples, [1] * len(samples), spec, check)


if __name__ == "__main__":
    main()
