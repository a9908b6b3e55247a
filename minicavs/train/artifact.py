"""Model artifacts (``.mcav``): a trained model in one file that runs without its Python module.

Container: an ``.npz`` (a zip of ``.npy`` members, read with ``allow_pickle=False``), as checkpoints are: the
zip's CRCs catch a damaged member, numpy reads it with no code of ours, and parameters stay inspectable
(``np.load(f)["param/W"]``). The entry ``__meta__`` is UTF-8 JSON::

    {"format": "minicavs-model", "version": 1, "minicavs": "0.1.0",
     "nodes": [...],                       # minicavs.ops.serialize's node table (constants under attr/<i>)
     "structures": [{"name", "kinds", "pulls": {name: node}, "pushed": {name: node},
                     "functions": [{"name", "arity", "message", "dtype", "gathers", "gather_kinds",
                                    "pulls", "pushes", "scattered"}]}],
     "outputs": {name: node}, "policy": "cavs", "options": {EngineOptions fields},
     "params": [{"name", "key", "trainable"}], "vocabulary": [...] | null, "config": {...},
     "behaviour": {"predicts", "reader", "graphs", "feeds", "render"}}   # names in minicavs.train.behaviour

Written atomically. :func:`load` checks the format, the version, every op and behaviour name, and every
reference before it builds anything; any problem is one :class:`ArtifactError` naming the file.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import sys
import time
import zipfile
from typing import Any, Callable, Sequence

import numpy as np

from .. import __version__
from ..core import atomic, onetime
from ..core.errors import MinicavsError
from ..engine.backend import to_host
from ..engine.compile import EngineOptions
from ..engine.model import Model, Structure, by_child_count
from ..ops.serialize import Decoder, Encoder, SerializeError
from ..nn import Parameter, ParameterSet
from ..runtime.vertex import VertexFunction
from .behaviour import PROBES, TABLES

FORMAT = "minicavs-model"
VERSION = 1
META_KEY = "__meta__"
SUFFIX = ".mcav"


class ArtifactError(MinicavsError, ValueError):
    """A model that cannot be exported, or a file that is not a loadable model artifact."""


# --- writing -------------------------------------------------------------------------------------------

def export(path: str | os.PathLike, task, cfg: dict) -> dict:
    """Write ``task``'s inference model, parameters, vocabulary, ``cfg`` and behaviour to ``path``
    (atomically); returns the metadata written. A part that exists only as Python code is refused."""
    spec = task.export_spec()
    model = task.model
    roots = list(spec["outputs"].values())
    for s in model.structures:
        roots += list(s.pulls.values())
        for f in s.functions.values():
            roots += list(f.graph.nodes) + list(f.gathers.values()) + list(f.pulls.values())
    try:
        enc = Encoder(roots)
    except SerializeError as e:
        raise ArtifactError(f"cannot export model {type(task).__name__}: {e}") from None
    pushes = _push_buffers(model.structures, enc)
    arrays = dict(enc.arrays)
    params = []
    for i, (name, p) in enumerate(task.params.items()):
        key = f"param/{i}"
        arrays[key] = np.ascontiguousarray(to_host(p.value))   # (a model on a device: its host copy)
        params.append({"name": name, "key": key, "trainable": p.trainable})
    meta = {"format": FORMAT, "version": VERSION, "minicavs": __version__, "nodes": enc.table,
            "structures": [_structure(s, enc, pushed) for s, pushed in zip(model.structures, pushes)],
            "outputs": {k: enc.ref(v) for k, v in spec["outputs"].items()},
            "policy": cfg["train"]["policy"], "options": dataclasses.asdict(model.options),
            "params": params, "vocabulary": task.vocabulary, "config": _plain(cfg),
            "behaviour": spec["behaviour"]}
    _check_behaviour(meta["behaviour"], f"model {type(task).__name__}")
    arrays[META_KEY] = np.frombuffer(json.dumps(meta, allow_nan=False).encode("utf-8"), np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic.write_bytes(path, buffer.getbuffer())
    return meta


def _push_buffers(structures: Sequence[Structure], enc: Encoder) -> list[dict]:
    """Per structure, {push name: node} of the push buffers the exported graphs read: those the structure
    has made (``Structure.pushes``, read-only: an export makes no buffer the model did not have)."""
    return [{k: node for k, node in sorted(s.pushes.items()) if node in enc.index} for s in structures]


def _structure(s: Structure, enc: Encoder, pushed: dict) -> dict:
    return {"name": s.name, "kinds": _kind_rule(s), "pulls": {k: enc.ref(v) for k, v in s.pulls.items()},
            "pushed": {k: enc.ref(v) for k, v in pushed.items()},
            "functions": [_function(f, enc) for f in s.functions.values()]}


def _kind_rule(s: Structure) -> dict | None:
    """The structure's kind rule as data: none (one function, or kinds given with the graphs) or
    :func:`by_child_count`; any other rule is Python code and is refused."""
    if s.kinds is None:
        return None
    named = getattr(s.kinds, "leaf_internal", None)
    if named is None:
        raise ArtifactError(f"cannot export structure '{s.name}': its kind rule "
                            f"{getattr(s.kinds, '__name__', repr(s.kinds))} exists only as Python code (a rule "
                            "that exports is minicavs.by_child_count(leaf, internal))")
    return {"rule": "by_child_count", "leaf": named[0], "internal": named[1]}


def _function(f: VertexFunction, enc: Encoder) -> dict:
    return {"name": f.name, "arity": f.arity, "message": None if f.message is None else list(f.message),
            "dtype": f.dtype.name, "gathers": [[k, enc.ref(n)] for k, n in f.gathers.items()],
            "gather_kinds": [[k, None if v is None else list(v)] for k, v in f.gather_kinds.items()],
            "pulls": {k: enc.ref(n) for k, n in f.pulls.items()},
            "pushes": {k: enc.ref(n) for k, n in f.pushes.items()},
            "scattered": None if f.scattered is None else enc.ref(f.scattered)}


def _plain(cfg: dict) -> Any:
    """The config as JSON (it came from YAML: plain values; anything else is written as its text)."""
    return json.loads(json.dumps(cfg, default=str))


def _check_behaviour(behaviour: Any, where: str) -> None:
    if not isinstance(behaviour, dict):
        raise ArtifactError(f"{where}: behaviour is not a table")
    parts = [("reader", behaviour.get("reader")), ("render", behaviour.get("render"))]
    parts += [("decoder", behaviour["decoder"])] if "decoder" in behaviour else [("graphs", behaviour.get("graphs"))]
    parts += [("feed", f) for f in (behaviour.get("feeds") or {}).values()]
    for table, entry in parts:
        name = entry.get("name") if isinstance(entry, dict) else None
        if name not in TABLES[table]:
            raise ArtifactError(f"{where}: {table} {name!r} is not one this minicavs knows "
                                f"({', '.join(TABLES[table])})")


# --- reading -------------------------------------------------------------------------------------------

def read(path: str | os.PathLike) -> tuple[dict, dict]:
    """(metadata, arrays) of an artifact file, checked for format and version; one ArtifactError if not."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(bytes(arrays.pop(META_KEY)).decode("utf-8"))
    except FileNotFoundError:
        raise ArtifactError(f"model file not found: {path}") from None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path} is not a readable minicavs model artifact (damaged, truncated or another "
                            f"kind of file: {type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a minicavs model artifact (format {meta.get('format')!r})"
                            if isinstance(meta, dict) else f"{path}: metadata is not a table")
    version = meta.get("version")
    if not isinstance(version, int) or version > VERSION or version < 1:
        raise ArtifactError(f"{path}: model format version {version!r}, this minicavs {__version__} reads "
                            f"versions 1..{VERSION} (written by a newer minicavs? upgrade it)")
    return meta, arrays


def _on_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def load(path: str | os.PathLike, say: Callable[[str], None] | None = _on_stderr) -> "LoadedModel":
    """The model an artifact holds, ready to predict (``minicavs.load``); raises ArtifactError.

    Loading builds the model's kernels now, not in its first request: it compiles them (or finds them in the
    kernel cache) and runs one probe input of the model's reader through them (the C runner's libraries are
    built on a first run). ``say`` hears one line saying how many kernels and whether the cache had them
    (default: stderr; None: quiet)."""
    meta, arrays = read(path)
    compiling: list = []   # what the compiler said it compiled (once per kind of work: on a cache miss)
    start = time.perf_counter()
    try:
        with onetime.announcing(compiling.append):
            model = LoadedModel(meta, arrays)
            model.outputs([model.parse_input(PROBES[model.behaviour["reader"]["name"]], "probe")])
    except (SerializeError, KeyError, TypeError, ValueError, IndexError) as e:
        raise ArtifactError(f"{os.fspath(path)}: damaged model artifact ({type(e).__name__}: {e})") from None
    if say is not None:
        say(f"minicavs: loaded {os.fspath(path)}: {kernel_note(model, compiling)}, "
            f"{time.perf_counter() - start:.1f} s")
    return model


def kernel_note(model: "LoadedModel", compiling: list) -> str:
    """How many fused kernels ``model``'s forward pass runs and whether they came from the kernel cache
    (``compiling``: what the compiler announced while loading; nothing on a cache hit)."""
    opts, device = model.model.options, model.model.device
    missing = device.runner_missing(model.model.structures[0].dtype.np) if model.model.structures else None
    if missing:
        return f"no C runner ({missing}): it runs unfused with numpy, slowly"
    kernels = sum(len(groups) for s in model.model.structures for fn in s.compiled.values()
                  for groups in fn.variant(opts).phases(opts, device).forward.groups)
    what = f"{kernels} fused kernels and the C runner"
    if compiling:
        where = re.search(r"cached in (.*)\)", compiling[0])
        return f"compiled its kernels ({what}; cache miss, now cached in {where[1] if where else '?'})"
    return f"its kernels ({what}) from the kernel cache (hit)"


class LoadedModel:
    """An exported model: parse input lines, predict, render, as ``minicavs predict`` does with a Task."""

    def __init__(self, meta: dict, arrays: dict):
        _check_behaviour(meta["behaviour"], "artifact")
        dec = Decoder(meta["nodes"], arrays)
        structures = [_rebuild_structure(s, dec) for s in meta["structures"]]
        self.config = meta["config"]
        self.behaviour = meta["behaviour"]
        self.predicts = self.behaviour.get("predicts", "")
        self.vocabulary = meta["vocabulary"]
        self.index = {w: i for i, w in enumerate(self.vocabulary or ())}
        self.params = ParameterSet(Parameter(p["name"], arrays[p["key"]].shape, init=arrays[p["key"]],
                                             dtype=arrays[p["key"]].dtype, trainable=p["trainable"])
                                   for p in meta["params"])
        outputs = {k: dec.node(v) for k, v in meta["outputs"].items()}
        dec.check_all()
        self.model = Model(structures, outputs=outputs, policy=meta["policy"],
                           options=EngineOptions(**meta["options"]))
        self.model.plan_buffers(self.params)
        self.params.read_only()   # (it only predicts: the C runner keeps its transposed copies across batches)

    def parse_input(self, line: str, where: str) -> Any:
        reader = self.behaviour["reader"]
        return TABLES["reader"][reader["name"]](line, where, **reader.get("settings", {}))

    def outputs(self, samples: Sequence[Any]) -> dict:
        """The model's outputs (name -> array) for one batch of parsed samples, through one schedule (or, for a
        model with a decoder, through the decoder's loop of them)."""
        b = self.behaviour
        if "decoder" in b:
            return TABLES["decoder"][b["decoder"]["name"]](self._infer, samples, **b["decoder"].get("settings", {}))
        graphs = TABLES["graphs"][b["graphs"]["name"]](samples, **b["graphs"].get("settings", {}))
        feeds = {name: TABLES["feed"][f["name"]](samples, self.index, **f.get("settings", {}))
                 for name, f in b["feeds"].items()}
        return self._infer(graphs, feeds)

    def _infer(self, graphs: Any, feeds: dict) -> dict:
        return self.model.infer(graphs, feeds, self.params).outputs

    def render(self, samples: Sequence[Any], outputs: dict) -> list[dict]:
        """Per sample its output row (``text`` and the numbers behind it), as the model's predict writes it."""
        render = self.behaviour["render"]
        return TABLES["render"][render["name"]](samples, outputs, self.vocabulary, **render.get("settings", {}))

    def predict(self, samples: Sequence[Any], batch_size: int = 64) -> list[dict]:
        rows: list[dict] = []
        for i in range(0, len(samples), batch_size):
            chunk = samples[i:i + batch_size]
            rows += self.render(chunk, self.outputs(chunk))
        return rows

def _rebuild_structure(s: dict, dec: Decoder) -> Structure:
    functions = {}
    for f in s["functions"]:
        fn = VertexFunction(f["name"], f["arity"], f["message"], f["dtype"])
        fn.gathers = {int(k): dec.node(v) for k, v in f["gathers"]}
        fn.gather_kinds = {int(k): None if v is None else tuple(v) for k, v in f["gather_kinds"]}
        fn.pulls = {k: dec.node(v) for k, v in f["pulls"].items()}
        fn.pushes = {k: dec.node(v) for k, v in f["pushes"].items()}
        fn.scattered = None if f["scattered"] is None else dec.node(f["scattered"])
        fn.graph   # (validates: it has outputs)
        functions[f["name"]] = fn
    rule = s["kinds"]
    if rule is not None and rule.get("rule") != "by_child_count":
        raise ValueError(f"structure '{s['name']}': unknown kind rule {rule.get('rule')!r}")
    kinds = None if rule is None else by_child_count(rule["leaf"], rule["internal"])
    out = Structure(functions, pulls={k: dec.node(v) for k, v in s["pulls"].items()}, kinds=kinds,
                    name=s["name"])
    for name, ref in sorted(s["pushed"].items(), key=lambda item: item[1]):   # (in table order)
        dec.give(ref, out.pushed(name))   # the engine's own push-buffer node, where the static graphs read it
    return out
