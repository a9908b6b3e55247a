"""Pretrained word vectors: the streaming reader (formats, gzip, errors naming FILE:LINE) and the embedding
table a model builds from them (rows filled, the rest at the initializer, dimension checks)."""
from __future__ import annotations

import gzip
import hashlib

import numpy as np
import pytest

from minicavs.data.vectors import FORMATS, KEYS, describe, embedding_table, read_vectors
from minicavs.core.errors import DataError
from minicavs.nn import Parameter, ParameterSet

VOCAB = ["<unk>", "the", "café", "日本", "movie", "good", "a.b"]
DIM = 4


def known_vectors(words, dim=DIM, seed=0) -> dict:
    """word -> vector whose values print exactly in %.6g (so the file's text is the value)."""
    rng = np.random.default_rng(seed)
    return {w: np.round(rng.uniform(-2, 2, dim), 4) for w in words}


def write(path, lines: list[str], header: str | None = None, trailing: str = "") -> str:
    """A vector file: ``header`` then ``lines`` (each followed by ``trailing`` and a newline); gzip for .gz."""
    text = "".join(f"{line}{trailing}\n" for line in ([header] if header is not None else []) + lines)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(text.encode("utf-8"))
    return str(path)


def line(word, vec) -> str:
    return word + " " + " ".join(f"{v:.6g}" for v in vec)


# the file holds these words: some of the vocabulary (unicode ones too), others not
IN_FILE = ["the", "zebra", "café", "日本", "unrelated", "a.b"]


@pytest.mark.parametrize("fmt, name, header", [
    ("glove", "vectors.txt", False), ("word2vec-text", "vectors.txt", True), ("fasttext-vec", "wiki.vec", True)])
@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("given", ["auto", "exact"])
@pytest.mark.parametrize("trailing", ["", " "])   # word2vec writes a space after the last value
def test_reads_each_format(tmp_path, fmt, name, header, gz, given, trailing):
    vecs = known_vectors(IN_FILE)
    path = write(tmp_path / (name + (".gz" if gz else "")), [line(w, vecs[w]) for w in IN_FILE],
                 f"{len(IN_FILE)} {DIM}" if header else None, trailing)
    got = read_vectors(path, VOCAB, fmt if given == "exact" else "auto", "float64")
    assert got.format == fmt and got.dim == DIM and got.lines == len(IN_FILE) and got.duplicates == 0
    expected_found = [w in IN_FILE for w in VOCAB]
    assert got.found.tolist() == expected_found
    for i, w in enumerate(VOCAB):
        if w in IN_FILE:
            np.testing.assert_array_equal(got.rows[i], vecs[w])
        else:
            assert not got.rows[i].any()


def test_rows_are_cast_to_the_tables_dtype(tmp_path):
    vecs = known_vectors(["the"])
    path = write(tmp_path / "v.txt", [line("the", vecs["the"])])
    got = read_vectors(path, VOCAB, dtype="float32")
    assert got.rows.dtype == np.float32
    np.testing.assert_array_equal(got.rows[1], vecs["the"].astype(np.float32))


def test_a_duplicate_keeps_the_first_vector_and_is_counted(tmp_path):
    first, second = known_vectors(["the"], seed=1)["the"], known_vectors(["the"], seed=2)["the"]
    path = write(tmp_path / "v.txt", [line("the", first), line("good", first), line("the", second),
                                      line("other", second), line("other", first), line("the", second)])
    got = read_vectors(path, VOCAB, dtype="float64")
    np.testing.assert_array_equal(got.rows[VOCAB.index("the")], first)
    assert got.duplicates == 2          # the two later lines of "the" (a word outside the vocabulary: not kept)
    assert got.lines == 6


def test_blank_lines_a_bom_and_words_with_spaces(tmp_path):
    """GloVe's 840B file has words such as '. . .'; a byte order mark and blank lines are tolerated."""
    vecs = known_vectors(["the", ". . ."])
    path = tmp_path / "v.txt"
    path.write_bytes(b"\xef\xbb\xbf" + (line("the", vecs["the"]) + "\n\n" + line(". . .", vecs[". . ."])
                                        + "\n").encode())
    got = read_vectors(str(path), VOCAB + [". . ."], dtype="float64")
    assert got.found.tolist() == [False, True] + [False] * 5 + [True]
    np.testing.assert_array_equal(got.rows[-1], vecs[". . ."])
    assert got.lines == 2


def test_the_record_hashes_the_rows_used(tmp_path):
    vecs = known_vectors(IN_FILE)
    path = write(tmp_path / "v.txt", [line(w, vecs[w]) for w in IN_FILE])
    record = read_vectors(path, VOCAB, dtype="float32").record()
    ids = [i for i, w in enumerate(VOCAB) if w in IN_FILE]
    h = hashlib.sha256(np.array(ids, "<i8").tobytes())
    h.update(np.stack([vecs[VOCAB[i]] for i in ids]).astype("<f4").tobytes())
    assert record == {"path": path, "format": "glove", "dim": DIM, "found": len(ids), "words": len(VOCAB),
                      "duplicates": 0, "lines": len(IN_FILE), "sha256": h.hexdigest()}
    assert describe("E", record, frozen=True).startswith(
        f"pretrained: {len(ids)} of {len(VOCAB)} words found ({100 * len(ids) / len(VOCAB):.1f}%) in {path}")


# --- malformed files: each an error naming FILE:LINE ---------------------------------------------------

BAD_VALUES = [("wrong count: too few", "0.1 0.2 0.3", "3 values, expected 4"),
              ("wrong count: too many", "0.1 0.2 0.3 0.4 0.5", "5 values, expected 4"),
              ("not a number", "0.1 abc 0.3 0.4", "value 2 is 'abc', not a number"),
              ("nan", "0.1 0.2 nan 0.4", "value 3 is 'nan': NaN and infinite"),
              ("NaN", "NaN 0.2 0.3 0.4", "value 1 is 'NaN': NaN and infinite"),
              ("inf", "0.1 0.2 0.3 inf", "value 4 is 'inf': NaN and infinite"),
              ("-Infinity", "0.1 -Infinity 0.3 0.4", "value 2 is '-Infinity': NaN and infinite"),
              ("double space", "0.1  0.2 0.3", "value 2 is empty \\(values are separated by single spaces\\)")]


@pytest.mark.parametrize("what, values, message", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
@pytest.mark.parametrize("word", ["good", "unrelated"])   # a vocabulary word's line, and any other line
@pytest.mark.parametrize("header", [False, True])
def test_a_malformed_line_is_an_error_naming_file_and_line(tmp_path, what, values, message, word, header):
    good = known_vectors(["the", "movie"])
    lines = [line("the", good["the"]), line("movie", good["movie"]), f"{word} {values}"]
    path = write(tmp_path / "v.txt", lines, f"3 {DIM}" if header else None)
    with pytest.raises(DataError, match=f"^{path}:{3 + header}: {message}"):
        read_vectors(path, VOCAB)


def test_a_value_out_of_the_dtypes_range_is_refused(tmp_path):
    path = write(tmp_path / "v.txt", [line("the", [0.1] * DIM), "good 0.1 1e39 0.3 0.4"])
    with pytest.raises(DataError, match=f"^{path}:2: value 2 is '1e39', out of float32's range"):
        read_vectors(path, VOCAB, dtype="float32")
    assert read_vectors(path, VOCAB, dtype="float64").rows[VOCAB.index("good"), 1] == 1e39


def test_a_word_that_is_not_utf8_is_an_error(tmp_path):
    path = tmp_path / "v.txt"
    path.write_bytes((line("the", [0.1] * DIM) + "\n").encode() + b"caf\xe9 0.1 0.2 0.3 0.4\n")
    with pytest.raises(DataError, match=f"^{path}:2: the word is not UTF-8"):
        read_vectors(str(path), VOCAB)


@pytest.mark.parametrize("fmt", ["word2vec-text", "fasttext-vec"])
def test_a_header_format_needs_its_header(tmp_path, fmt):
    path = write(tmp_path / "v.txt", [line("the", [0.1] * DIM)])
    with pytest.raises(DataError, match=f"^{path}:1: expected the header line 'COUNT DIM' of a {fmt} file"):
        read_vectors(path, VOCAB, fmt)


@pytest.mark.parametrize("count, match", [(3, "announces 3 vectors, the file holds 2; is it truncated"),
                                          (1, "announces 1 vectors, the file holds 2$")])
def test_the_headers_count_must_hold(tmp_path, count, match):
    path = write(tmp_path / "v.vec", [line("the", [0.1] * DIM), line("good", [0.2] * DIM)], f"{count} {DIM}")
    with pytest.raises(DataError, match=f"^{path}: the header \\(line 1\\) {match}"):
        read_vectors(path, VOCAB)


def test_glove_given_for_a_file_with_a_header_says_so(tmp_path):
    path = write(tmp_path / "v.txt", [line("the", [0.1] * DIM)], f"1 {DIM}")
    with pytest.raises(DataError, match=f"^{path}:2: 4 values, expected 1 .*looks like a word2vec/fastText header"):
        read_vectors(path, VOCAB, "glove")


def test_a_damaged_gzip_file_is_an_error(tmp_path):
    path = write(tmp_path / "v.txt.gz", [line(f"w{i}", [0.1] * DIM) for i in range(2000)])
    data = (tmp_path / "v.txt.gz").read_bytes()
    (tmp_path / "v.txt.gz").write_bytes(data[:len(data) // 2])
    with pytest.raises(DataError, match=f"^{path}:\\d+: cannot be read"):
        read_vectors(path, VOCAB)


@pytest.mark.parametrize("make, match", [
    (lambda p: p, "file not found"), (lambda p: (p.mkdir(), p)[1], "is a directory"),
    (lambda p: (p.write_text(""), p)[1], "holds no vectors"),
    (lambda p: (p.write_text("the\n"), p)[1], ":1: a word without values")])
def test_missing_empty_and_wordonly_files(tmp_path, make, match):
    path = make(tmp_path / "v.txt")
    with pytest.raises(DataError, match=match):
        read_vectors(str(path), VOCAB)


def test_the_dimension_is_reported_before_the_rest_is_read(tmp_path):
    """on_dim can refuse a file at its first line: the malformed line 2 is never reached."""
    path = write(tmp_path / "v.txt", [line("the", [0.1] * DIM), "good nan"])
    seen = []

    def refuse(dim, where):
        seen.append((dim, where))
        raise ValueError("wrong dimension")
    with pytest.raises(ValueError, match="wrong dimension"):
        read_vectors(path, VOCAB, on_dim=refuse)
    assert seen == [(DIM, f"{path}:1")]


# --- the embedding table ---------------------------------------------------------------------------------

def cfg_for(tmp_path=None, restoring=None, **model) -> dict:
    cfg = {"model": {"embed": DIM, **KEYS, **model}, "train": {"dtype": "float64", "seed": 3}}
    if restoring is not None:
        cfg["restoring"] = restoring
    return cfg


def test_the_table_takes_the_files_rows_and_keeps_the_initializers_elsewhere(tmp_path):
    vecs = known_vectors(IN_FILE)
    path = write(tmp_path / "v.txt", [line(w, vecs[w]) for w in IN_FILE])
    plain = embedding_table(ParameterSet(), "E", VOCAB, cfg_for(), init="uniform(0.1)", dim=DIM)
    p = embedding_table(ParameterSet(), "E", VOCAB, cfg_for(pretrained=path), init="uniform(0.1)", dim=DIM)
    for i, w in enumerate(VOCAB):
        np.testing.assert_array_equal(p.value[i], vecs[w] if w in IN_FILE else plain.value[i])
    assert p.trainable and p.source["found"] == sum(w in IN_FILE for w in VOCAB) and p.source["path"] == path


def test_frozen_tables_and_extra_columns(tmp_path):
    vecs = known_vectors(IN_FILE, dim=2)
    path = write(tmp_path / "v.txt", [line(w, vecs[w]) for w in IN_FILE])
    p = embedding_table(ParameterSet(), "E", VOCAB, cfg_for(pretrained=path), init="zeros", dim=2, extra_columns=3)
    assert p.shape == (len(VOCAB), 5)
    np.testing.assert_array_equal(p.value[VOCAB.index("the")], list(vecs["the"]) + [0, 0, 0])
    frozen = embedding_table(ParameterSet(), "E", VOCAB, cfg_for(pretrained=path, freeze_embeddings=True),
                             init="zeros", dim=2)
    assert not frozen.trainable and frozen.node.attrs.get("frozen")
    with pytest.raises(ValueError, match="model.freeze_embeddings: table E holds more than the word vectors"):
        embedding_table(ParameterSet(), "E", VOCAB, cfg_for(pretrained=path, freeze_embeddings=True),
                        init="zeros", dim=2, extra_columns=3)


@pytest.mark.parametrize("header", [False, True])
def test_a_wrong_dimension_names_both(tmp_path, header):
    path = write(tmp_path / "v.txt", [line(w, [0.5] * 3) for w in IN_FILE], f"{len(IN_FILE)} 3" if header else None)
    with pytest.raises(ValueError, match=f"model.embed = {DIM}, but model.pretrained {path} holds 3-dimensional "
                                         f"vectors \\({path}:1\\); set model.embed: 3, or null to take the file's"):
        embedding_table(ParameterSet(), "E", VOCAB, cfg_for(pretrained=path), init="zeros", dim=DIM)
    with pytest.raises(ValueError, match="model.hidden = 4, but .* set model.hidden: 3$"):
        embedding_table(ParameterSet(), "E", VOCAB, cfg_for(pretrained=path), init="zeros", dim=DIM,
                        dim_key="model.hidden")
    taken = embedding_table(ParameterSet(), "E", VOCAB, cfg_for(pretrained=path), init="zeros", dim=None)
    assert taken.shape == (len(VOCAB), 3)


def test_a_null_dimension_needs_a_file():
    with pytest.raises(ValueError, match="model.embed is null, which takes the dimension from model.pretrained"):
        embedding_table(ParameterSet(), "E", VOCAB, cfg_for(), init="zeros", dim=None)


def test_restoring_reads_no_file(tmp_path):
    """When the trainer will load every parameter from a checkpoint, the file may be gone."""
    record = {"path": str(tmp_path / "gone.txt"), "format": "glove", "dim": 5, "found": 1, "words": 7}
    p = embedding_table(ParameterSet(), "E", VOCAB, cfg_for(pretrained=record["path"], freeze_embeddings=True,
                                                            restoring={"pretrained": {"E": record}}),
                        init="zeros", dim=None)
    assert p.shape == (len(VOCAB), 5) and p.source == record and not p.trainable


def test_the_keys_and_formats():
    assert KEYS == {"pretrained": None, "pretrained_format": "auto", "freeze_embeddings": False}
    assert FORMATS == ("auto", "glove", "word2vec-text", "fasttext-vec")
    assert isinstance(Parameter("x", (1,)).trainable, bool)


@pytest.mark.parametrize("gz", [False, True])
def test_memory_is_bounded_by_the_vocabulary_not_the_file(tmp_path, gz):
    """A 6 MB file read for 10 words: the reader's peak allocation stays far below the file's size (it
    streams lines and keeps the vocabulary's rows only)."""
    import tracemalloc
    rng = np.random.default_rng(0)
    pool = [" ".join(f"{x:.6f}" for x in rng.standard_normal(300)) for _ in range(50)]
    lines = [f"w{i} {pool[i % 50]}" for i in range(2000)]
    path = write(tmp_path / ("big.txt" + (".gz" if gz else "")), lines)
    vocab = [f"w{i}" for i in range(0, 2000, 200)]
    tracemalloc.start()
    try:
        got = read_vectors(path, vocab)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.found.all() and got.lines == 2000
    assert sum(map(len, lines)) > 5_000_000 and peak < 1_000_000
