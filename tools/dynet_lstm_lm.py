"""The bench's LSTM language models (Var-LSTM on sentences, Fixed-LSTM on 64-word windows) in DyNet 2.2 with
autobatching, for `minicavs bench --dynet-python`.

Same function as models/var_lstm.py (and models/fixed_lstm.py, whose samples are windows) without dropout,
written per sample as a DyNet user writes it (DyNet's rnnlm example): DyNet's ``VanillaLSTMBuilder`` run
over the sample's embedded inputs, then at every step softmax(W_o·h + b_o) and the negative log-likelihood
of the target; loss = summed cross-entropy / samples. The builder's gates are i, f, o, g with
[i, f, o, g] = W_x·x + W_h·h + b, minicavs' order and equations, so minicavs' W_x, W_h (transposed) and b
become the builder's parameters unchanged; it is built with forget_bias=0 (DyNet adds 1 to f by default)
and starts every sample from zero h and c, as minicavs' chain does.

Runs in DyNet's own environment (tools/setup_peers.sh) and imports nothing from minicavs. Input: one JSON
spec naming an .npz of weights (rows @ W, as minicavs stores them: E, W_x, W_h, b, W_o, b_o) and an .npz of
data (inputs and targets of all samples concatenated, ptr: sample offsets); output: one JSON line (the
protocol of minicavs/bench/peers.py; units are words, i.e. predictions; DyNet settings and optimizer:
tools/dynet_peer.py).

    python tools/dynet_lstm_lm.py SPEC.json
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
    lstm = lstm_builder(dy, pc, w["W_x"], w["W_h"], w["b"])
    W_o = pc.parameters_from_numpy(np.ascontiguousarray(w["W_o"].T))
    b_o = pc.parameters_from_numpy(w["b_o"])

    def sample_loss(inputs, targets):
        hs = lstm.initial_state().transduce([dy.lookup(E, i) for i in inputs])
        return dy.esum([dy.pickneglogsoftmax(dy.affine_transform([b_o, W_o, h]), y) for h, y in zip(hs, targets)])

    def batch_loss(batch):
        return dy.esum([sample_loss(x, y) for x, y in batch]) / len(batch)

    check = check_loss(dy, batch_loss, samples[:spec["check"]])
    train_and_report(dy, pc, batch_loss, samples, [len(y) for _, y in samples], spec, check)


if __name__ == "__main__":
    main()
