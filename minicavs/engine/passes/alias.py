"""Aliasing: where each value of F and ∂F lives, decided once at compile time (§3.3, DESIGN.md's
schedule-first layout), so binding a batch only turns these decisions into views of its buffers.

- One scatter tensor per message shape: a kind writes its scattered value into the tensor of its shape
  (:func:`scatter_message`), and each gather reads the tensor of the shape it declared
  (:func:`gather_messages`; the structure checks that the kinds it reads scatter that shape). Every such
  tensor is indexed by the vertex's row in the whole task order, so rows and views are the same for all.
- The scatter tensor holds the scattered value; ∂F reads it (or a column block of a scattered concat such as
  ``[h, c]``) back from there, never from a copy of its own (:func:`scatter_parts`).
- Pulled rows ∂F reads are read again from the pull buffer, which outlives the backward pass.
- Every other per-vertex value ∂F reads gets a dynamic tensor (:func:`forward_tensors`).
- ``[gather(0); ...; gather(K-1)]`` of siblings side by side is a reshape of the scatter tensor
  (:func:`gather_concat`, when gather elision finds the children rows start + K*i + j).
- A concat whose parts all come out of fused kernels disappears: the kernels write the parts straight into
  column blocks of the concat's buffer (:func:`elide_concats`).
- A value stored in a tensor is written there in place by the kernel computing it, or copied after its
  phase's steps (:func:`stores`).
"""
from __future__ import annotations

from ...ir.graph import Node
from ...ops.registry import OPS


def column_blocks(n: Node) -> list | None:
    """[(input, first column, end)] when ``n``'s value is its inputs side by side (the registry's answer)."""
    blocks = OPS[n.op].column_blocks
    return None if blocks is None else blocks(n)


def scatter_source(scattered: Node | None) -> Node | None:
    """The value the scatter tensor receives (``scatter`` is an identity op on it)."""
    if scattered is None:
        return None
    return scattered.inputs[0] if OPS[scattered.op].identity else scattered


def scatter_message(scattered: Node | None) -> tuple | None:
    """The message shape a kind scatters: which scatter tensor its scattered value lives in."""
    return None if scattered is None else scattered.vshape


def gather_messages(gathers: dict) -> dict:
    """{gather slot: message shape}: which scatter tensor each gather reads (and its adjoint adds into)."""
    return {k: node.vshape for k, node in gathers.items()}


def message_tensors(scattered_nodes) -> list:
    """The scatter tensors of a structure: one per distinct message shape its kinds scatter."""
    return sorted({scatter_message(n) for n in scattered_nodes if n is not None})


def scatter_parts(scattered: Node | None, backward_reads: set) -> dict:
    """{value ∂F reads: (first column, end)} for the scattered value and the column blocks of a scattered
    concat: read back from the scatter tensor's rows."""
    source = scatter_source(scattered)
    parts = {}
    if source is not None and len(source.shape) == 2:
        parts[source] = (0, source.shape[1])
        parts.update((x, (a, b)) for x, a, b in column_blocks(source) or ())
    return {n: cols for n, cols in parts.items() if n in backward_reads}


def pull_reads(pulls: dict, backward_reads: set) -> dict:
    """{pull name: pull node} for the pulled rows ∂F reads: read again from the pull buffer."""
    return {name: n for name, n in pulls.items() if n in backward_reads}


def forward_tensors(nodes, backward_reads: set, in_scatter: dict, in_pulls: dict) -> list:
    """F's per-vertex values that ∂F reads and no other buffer already holds: each gets a dynamic tensor."""
    pulled = set(in_pulls.values())
    return [n for n in nodes if n.has_rows and n in backward_reads and n not in in_scatter and n not in pulled]


def gather_concat(row_nodes, gathers: list) -> Node | None:
    """The concat of all gathers, in slot order, of per-vertex vectors of one message shape (they read one
    scatter tensor): a reshape of that tensor when the children's rows are adjacent."""
    if (len(gathers) < 2 or not all(len(x.vshape) == 1 for x in gathers)
            or len({x.vshape for x in gathers}) > 1):
        return None
    return next((n for n in row_nodes if [x for x, _, _ in column_blocks(n) or ()] == gathers), None)


def elide_concats(program: list) -> tuple[list, list]:
    """Concats along the last axis whose parts are all outputs of fused steps of this program, or of its lone
    elementwise steps (one kernel each: a Tree-LSTM ∂F's ``[dc_child; dh_child]`` concats had one such part and
    copied both): the kernels write the parts straight into column blocks of the concat's buffer and the
    concat step disappears. Returns the program without them and [(concat, [(part, first column, end)])]."""
    made = {o for st in program if st.fused or _lone_elementwise(st) for o in st.outputs}
    out, concats, taken = [], [], set()
    for st in program:
        n = st.outputs[0]
        blocks = column_blocks(n) if not st.fused else None
        if blocks and all(x in made and x not in taken for x in n.inputs):
            concats.append((n, blocks))
            taken.update(n.inputs)
            continue
        out.append(st)
    return out, concats


def _lone_elementwise(step) -> bool:
    """A step of one elementwise node that fusion left alone and that has no lowering of its own: the runners
    compute it with a one-node kernel (or its op's implementation) into the register its output already has."""
    if step.fused or len(step.outputs) != 1:
        return False
    node = step.outputs[0]
    opdef = OPS[node.op]
    return (opdef.fusible and node.dtype.is_float and not opdef.identity and not opdef.needs_ctx
            and (opdef.native is None or opdef.native(node) is None))


def stores(stored: set, inplace: set, concats: list, computed: list) -> tuple[list, list]:
    """The values a phase computes that live in a tensor (``stored``), split into those its steps write in
    place (a fused kernel's output, an elided concat's buffer) and those copied after its steps. A concat's
    parts are written into the concat's buffer, so a part stored in its own tensor is copied there."""
    parts = {m for _, ms in concats for m, _, _ in ms}
    direct = (inplace - parts) | {c for c, _ in concats}
    computed = list(computed) + [c for c, _ in concats if c not in computed]
    kept = [n for n in computed if n in stored]
    return [n for n in kept if n in direct], [n for n in kept if n not in direct]
