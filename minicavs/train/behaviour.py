"""What a model does around its graph, by name: so that an exported model can state it as data.

An artifact (:mod:`minicavs.train.artifact`) names one entry of each table with its settings, and the model
that wrote it uses the same functions, so the two cannot drift apart:

- ``READERS``: parse one input line into a sample (``reader(line, where, **settings)``);
- ``GRAPHS``: the input graphs of a chunk of samples;
- ``FEEDS``: one feed array of a chunk (``feed(samples, vocabulary index, **settings)``);
- ``RENDERERS``: per sample its output row (``text`` and the numbers behind it) from the model's outputs;
- ``DECODERS``: for a model whose outputs come from a loop of runs (greedy decoding over growing graphs),
  that loop (``decoder(infer, samples, **settings)``).

A model whose reading, feeding or rendering is none of these exists only as Python code, and exporting it is
refused (``Task.export_spec``).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import numpy as np

from ..core.errors import DataError
from ..data.sst import parse_any_tree
from ..data.trees import Tree, two_type_kinds
from ..runtime.inputs import InputGraph


def read_tree(line: str, where: str, num_labels: int, max_children: int) -> Tree:
    return parse_any_tree(line, where, num_labels=num_labels, max_children=max_children)


def tree_graphs(trees: Sequence[Tree]) -> list:
    return InputGraph.many([t.children for t in trees])


def two_type_trees(trees: Sequence[Tree], seed: int, stream: int, types: Sequence[str]) -> list:
    """The input graphs of trees whose internal vertices are of one of ``types`` at random (TreeLSTM-2Type):
    drawn per tree from (``seed``, ``stream``), the stream a tree outside the data splits gets."""
    return InputGraph.many([t.children for t in trees],
                           [two_type_kinds(t, seed, stream, tuple(types)) for t in trees])


def leaf_word_ids(trees: Sequence[Tree], index: dict, unknown: str) -> np.ndarray:
    """The vocabulary id of every leaf's word, tree by tree; a word not in it reads as ``unknown``."""
    unk = index[unknown]
    return np.array([index.get(t.words[v], unk) for t in trees for v, ch in enumerate(t.children) if not ch],
                    np.int64)


def tree_labels(trees: Sequence[Tree], outputs: dict, vocabulary: list, output: str) -> list[dict]:
    """Each tree with its argmax label at every node, its root's label and probabilities (and the gold
    root label when the input had one)."""
    probs = np.split(outputs[output], np.cumsum([t.num_vertices for t in trees])[:-1])
    rows = []
    for tree, p in zip(trees, probs):
        labelled = Tree(tree.children, p.argmax(1), tree.words)
        row = {"text": labelled.to_bracket(), "label": int(p[-1].argmax()),
               "probs": [round(float(q), 6) for q in p[-1]]}
        if tree.labels[tree.root] >= 0:
            row["gold"] = int(tree.labels[tree.root])
        rows.append(row)
    return rows


# --- digit sequences (the bundled seq2seq model: a foreach encoder, a while_loop greedy decoder) ----------

def read_digits(line: str, where: str, max_len: int) -> np.ndarray:
    """Digits separated by spaces or not, 1 to ``max_len`` of them."""
    digits = [ch for ch in line if not ch.isspace()]
    if not digits or not all(ch in "0123456789" for ch in digits):
        raise DataError(f"{where}: expected digits, got {line.strip()!r}")
    if len(digits) > max_len:
        raise DataError(f"{where}: {len(digits)} digits; this model reads at most {max_len} (model.max_len)")
    return np.array([int(ch) for ch in digits], np.int64)


def no_graphs(samples: Sequence) -> dict:
    """A model of static graphs only (its loops are control-flow ops): no input graphs."""
    return {}


def _lengths(samples: Sequence[np.ndarray]) -> np.ndarray:
    return np.fromiter(map(len, samples), np.int64, len(samples))


def _within(lengths: np.ndarray, width: int) -> np.ndarray:
    """(samples, width) bools: position j of sample r is one of its ``lengths[r]`` items."""
    return np.arange(width) < lengths[:, None]


def padded_source(samples: Sequence[np.ndarray], index: dict, max_len: int) -> np.ndarray:
    """The digits of each sample from the left, zeros after them (one numpy pass, no loop over samples:
    a training step builds it for every batch)."""
    src = np.zeros((len(samples), max_len), np.int64)
    if len(samples):
        src[_within(_lengths(samples), max_len)] = np.concatenate(samples)
    return src


def source_mask(samples: Sequence[np.ndarray], index: dict, max_len: int, dtype: str) -> np.ndarray:
    return _within(_lengths(samples), max_len).astype(dtype)


def reversed_source(src: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each row of the padded ``src`` with its first ``lengths[r]`` items reversed, zeros after them."""
    width = src.shape[1]
    back = np.clip(lengths[:, None] - 1 - np.arange(width), 0, max(width - 1, 0))
    return np.where(_within(lengths, width), np.take_along_axis(src, back, axis=1), 0)


def reversed_decoder_input(samples: Sequence[np.ndarray], index: dict, max_len: int, go: int,
                           eos: int) -> np.ndarray:
    """<go>, then the source reversed, then <eos> (teacher forcing's input; greedy decoding reads <go>)."""
    lengths = _lengths(samples)
    out = np.full((len(samples), max_len + 1), eos, np.int64)
    out[:, 0] = go
    within = _within(lengths, max_len)
    out[:, 1:][within] = reversed_source(padded_source(samples, index, max_len), lengths)[within]
    return out


def zero_state(samples: Sequence, index: dict, width: int, dtype: str) -> np.ndarray:
    return np.zeros((len(samples), width), dtype)


def tokens_until(samples: Sequence, outputs: dict, vocabulary, output: str, eos: int) -> list[dict]:
    """Per sample its decoded tokens (argmax of the one-hot rows) up to the first ``eos``; steps that never
    ran are zeros, whose argmax 0 comes after <eos>."""
    return ids_until(samples, {output: np.argmax(np.asarray(outputs[output]), axis=-1)}, vocabulary, output, eos)


def ids_until(samples: Sequence, outputs: dict, vocabulary, output: str, eos: int) -> list[dict]:
    """Per sample its decoded digits (a row of token ids) up to the first ``eos``."""
    rows = []
    for row in np.asarray(outputs[output]):
        stop = np.flatnonzero(row == eos)
        digits = [int(d) for d in (row[:stop[0]] if stop.size else row)]
        rows.append({"text": "".join(map(str, digits)), "digits": digits})
    return rows


@functools.lru_cache(maxsize=None)
def encoder_decoder(n: int, m: int) -> InputGraph:
    """n encoder vertices, then m decoder vertices hanging off the encoder's last one (bundled lstm_nmt; made
    once per shape: a graph is read-only, and its checks cost ~10% of a training step)."""
    return InputGraph([[v - 1] if v else [] for v in range(n + m)], ["enc"] * n + ["dec"] * m)


def greedy_chains(infer: Callable[[list, dict], dict], sources: Sequence[np.ndarray], max_len: int, go: int,
                  eos: int, output: str) -> dict:
    """Greedy decoding on encoder-decoder chains (bundled lstm_nmt): run the graphs again with one more
    decoder vertex per step, fed its own choice (the argmax of ``output`` at each sample's last decoder
    vertex), for the samples not yet at ``eos``, up to ``max_len + 1`` steps. ``infer(graphs, feeds)`` gives
    the model's outputs. Returns ``{"decoded": (samples, max_len + 1) token ids}``, ``eos`` after the end."""
    prefixes, active = [[go] for _ in sources], list(range(len(sources)))
    for _ in range(max_len + 1):
        graphs = [encoder_decoder(len(sources[k]), len(prefixes[k])) for k in active]
        tokens = np.concatenate([np.concatenate((sources[k], prefixes[k])) for k in active]).astype(np.int64)
        last = np.cumsum([len(prefixes[k]) for k in active]) - 1
        choice = np.argmax(infer(graphs, {"tokens": tokens, "last": last})[output], axis=1)
        for k, token in zip(active, choice.tolist()):
            prefixes[k].append(token)
        active = [k for k in active if prefixes[k][-1] != eos]
        if not active:
            break
    decoded = np.full((len(sources), max_len + 1), eos, np.int64)
    for row, q in zip(decoded, prefixes):
        row[:len(q) - 1] = q[1:]
    return {"decoded": decoded}


# --- tagged sentences (the bundled BiLSTM tagger: a forward and a backward chain per sentence) -----------

def read_numbered_words(line: str, where: str, prefix: str, size: int) -> tuple:
    """Words ``<prefix>0`` .. ``<prefix><size-1>`` separated by spaces: (their numbers, zero tags: unknown)."""
    tokens = line.split()
    known = {f"{prefix}{k}" for k in range(size)}
    bad = [w for w in tokens if w not in known]
    if bad or not tokens:
        raise DataError(f"{where}: " + (f"unknown words {bad}" if bad else "no words")
                        + f" (known: {prefix}0 .. {prefix}{size - 1})")
    words = np.array([int(w[len(prefix):]) for w in tokens], np.int64)
    return words, np.zeros(len(words), np.int64)


def two_chains(n: int) -> InputGraph:
    """A sentence of n words as a forward chain over them, then a backward chain (bundled bilstm_tagger)."""
    children = [[t - 1] if t else [] for t in range(n)] + [[n + j - 1] if j else [] for j in range(n)]
    return InputGraph(children, ["fwd"] * n + ["bwd"] * n)


def chain_pairs(sentences: Sequence[tuple]) -> list:
    return [two_chains(len(words)) for words, _ in sentences]


def words_then_reversed(sentences: Sequence[tuple], index: dict) -> np.ndarray:
    """Per sentence its words (the forward chain reads them), then reversed (the backward chain)."""
    return np.concatenate([np.concatenate((w, w[::-1])) for w, _ in sentences])


def backward_rows(sentences: Sequence[tuple], index: dict) -> np.ndarray:
    """Per word, the row of the backward-chain vertex that read it (word t of n: the (n-1-t)-th)."""
    lengths = np.array([len(w) for w, _ in sentences], np.int64)
    starts = np.cumsum(lengths) - lengths
    return np.concatenate([s + n - 1 - np.arange(n) for s, n in zip(starts, lengths)])


def word_tags(sentences: Sequence[tuple], outputs: dict, vocabulary: list, output: str) -> list[dict]:
    """Each word with its argmax tag, ``word/tag``."""
    tags = np.asarray(outputs[output]).argmax(1)
    rows = []
    for words, _ in sentences:
        mine, tags = tags[:len(words)], tags[len(words):]
        rows.append({"text": " ".join(f"{vocabulary[w]}/{t}" for w, t in zip(words, mine)),
                     "tags": [int(t) for t in mine]})
    return rows


# --- sentences (the bundled language models on chain graphs) -------------------------------------------

def read_tokens(line: str, where: str) -> list[str]:
    return line.split()


def eos_chains(sentences: Sequence[list]) -> list:
    """One chain per sentence, a vertex per prediction: <eos> w_1..w_n predicts w_1..w_n <eos>."""
    return [InputGraph.chain(len(s) + 1) for s in sentences]


def _ids(tokens: list, index: dict, unknown: str) -> np.ndarray:
    unk = index[unknown]
    return np.array([index.get(w, unk) for w in tokens], np.int64)


def eos_then_ids(sentences: Sequence[list], index: dict, eos: str, unknown: str) -> np.ndarray:
    return np.concatenate([np.concatenate(([index[eos]], _ids(s, index, unknown))) for s in sentences])


def ids_then_eos(sentences: Sequence[list], index: dict, eos: str, unknown: str) -> np.ndarray:
    return np.concatenate([np.concatenate((_ids(s, index, unknown), [index[eos]])) for s in sentences])


def last_positions(sentences: Sequence[list], index: dict) -> np.ndarray:
    """Each sentence's last vertex in the batch's vertex order (where its next word is predicted)."""
    return np.cumsum([len(s) + 1 for s in sentences]) - 1


def perplexity(sentences: Sequence[list], outputs: dict, vocabulary: list, token_nll: str, next: str,
               top: int) -> list[dict]:
    """Per sentence its perplexity and log-likelihood (each word and the closing <eos>) and the ``top``
    likeliest next words."""
    lengths = np.array([len(s) + 1 for s in sentences])
    nll = np.add.reduceat(np.asarray(outputs[token_nll]).astype(np.float64), np.cumsum(lengths) - lengths)
    known = set(vocabulary)
    rows = []
    for tokens, n, sent_nll, logp in zip(sentences, lengths, nll, outputs[next]):
        best = np.argsort(-logp, kind="stable")[:top]
        nxt = [(vocabulary[k], float(np.exp(logp[k]))) for k in best]
        ppl = math.exp(sent_nll / n)
        rows.append({"text": f"perplexity {ppl:.2f}  log-likelihood {-sent_nll:.2f} ({n} predictions)  next: "
                             + ", ".join(f"{w} {p:.3f}" for w, p in nxt),
                     "perplexity": ppl, "log_likelihood": -float(sent_nll), "predictions": int(n),
                     "unknown_words": int(sum(w not in known for w in tokens)),
                     "next": [{"word": w, "prob": round(p, 6)} for w, p in nxt]})
    return rows


READERS: dict[str, Callable[..., Any]] = {"tree": read_tree, "digits": read_digits, "tokens": read_tokens,
                                          "numbered_words": read_numbered_words}
# per reader, an input line every model reading it accepts: loading runs it once, so that the kernels and the C
# runner's libraries are built at load time, not in the first request
PROBES = {"tree": "((a b) c)", "digits": "12", "tokens": "a b", "numbered_words": "w0 w1"}
GRAPHS: dict[str, Callable[..., Any]] = {"trees": tree_graphs, "two_type_trees": two_type_trees,
                                         "none": no_graphs, "eos_chains": eos_chains, "chain_pairs": chain_pairs}
FEEDS: dict[str, Callable[..., np.ndarray]] = {
    "leaf_word_ids": leaf_word_ids, "padded_source": padded_source, "source_mask": source_mask,
    "reversed_decoder_input": reversed_decoder_input, "zero_state": zero_state, "eos_then_ids": eos_then_ids,
    "ids_then_eos": ids_then_eos, "last_positions": last_positions, "words_then_reversed": words_then_reversed,
    "backward_rows": backward_rows}
RENDERERS: dict[str, Callable[..., list]] = {"tree_labels": tree_labels, "tokens_until": tokens_until,
                                             "ids_until": ids_until, "perplexity": perplexity, "word_tags": word_tags}
# how a model's outputs come from its graphs and feeds, when not by one run: a named loop of runs
DECODERS: dict[str, Callable[..., dict]] = {"greedy_chains": greedy_chains}
TABLES = {"reader": READERS, "graphs": GRAPHS, "feed": FEEDS, "render": RENDERERS, "decoder": DECODERS}
