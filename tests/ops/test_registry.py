"""The registry is covered: every op has a numpy reference and a test spec, and every op without a gradient
is declared so on purpose (with the reason) in the spec table."""
import ast
import dataclasses
import pathlib

import numpy as np
import pytest

import minicavs.ops as ops
from minicavs.ops.autodiff import grad
from minicavs.ops.registry import OPS, OpDef, register

from ..reference import LEAVES, REFERENCE, STRUCTURAL
from .specs import SPECS, build, check_forward, check_gradient


def test_every_op_has_a_spec_or_is_a_leaf():
    missing = set(OPS) - set(SPECS) - LEAVES - STRUCTURAL
    stale = (set(SPECS) | LEAVES | STRUCTURAL) - set(OPS)
    assert not missing, f"ops without a test spec in tests/ops/specs.py: {sorted(missing)}"
    assert not stale, f"specs or leaves for ops that are not registered: {sorted(stale)}"
    assert not set(SPECS) & LEAVES


def test_every_op_has_a_reference_or_is_a_leaf():
    assert set(OPS) == set(REFERENCE) | LEAVES | STRUCTURAL
    assert not set(REFERENCE) & (LEAVES | STRUCTURAL)


def test_reference_module_never_imports_minicavs():
    import tests.reference as ref
    tree = ast.parse(pathlib.Path(ref.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "numpy"}, imported


def test_leaves_have_no_kernel_and_no_gradient():
    for name in LEAVES:
        opdef = OPS[name]
        assert opdef.vjp is None
        with pytest.raises(RuntimeError):
            opdef.impl(np)


def test_every_spec_has_cases_with_unique_ids():
    for s in SPECS.values():
        ids = [c.id for c in s.cases]
        assert ids and len(ids) == len(set(ids)), s.name
        for c in s.cases:
            assert c.grad or c.why, f"{s.name}[{c.id}]: a forward-only case must say why"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_missing_gradients_are_declared(name):
    """vjp=None or a raising vjp must be listed in the spec with a reason; every other op has a vjp."""
    s, opdef = SPECS[name], OPS[name]
    if opdef.vjp is None:
        assert s.nondiff and not s.raises, f"{name} has vjp=None but its spec does not say why"
    elif s.raises:
        assert s.nondiff, name
    else:
        assert not s.nondiff, f"{name} has a vjp but its spec declares it non-differentiable"


@pytest.mark.parametrize("name", sorted(n for n, s in SPECS.items() if s.nondiff))
def test_nondifferentiable_ops_behave_as_declared(name):
    """vjp=None: gradients through the op are zero (checked against finite differences by the gradient
    tests too). A second-order-only op: asking for a gradient through it raises, naming the op."""
    s = SPECS[name]
    case = next((c for c in s.cases if c.args), None)
    if case is None:  # a leaf-like op with no inputs (constant): nothing can flow anywhere
        node = s.cases[0].build("float64")
        assert OPS[node.op].vjp is None and node.inputs == ()
        return
    nodes, outs, *_ = build(case, "float64", 2, 0)
    wrt = [n for n, a in zip(nodes, case.args) if a.is_float]
    loss = ops.sum(outs[0])
    if s.raises:
        with pytest.raises(NotImplementedError, match=name):
            grad(loss, wrt)
    else:
        assert all(g.op == "zeros_like" for g in grad(loss, wrt))


def test_registering_a_name_twice_is_refused():
    with pytest.raises(ValueError, match="registered twice"):
        register(OpDef("add", infer=None, impl=None, vjp=None))


def test_the_harness_catches_a_slightly_wrong_rule(monkeypatch):
    """Guard against a vacuous table: a kernel or a gradient off by a small relative error must fail."""
    s = SPECS["tanh"]
    case = next(c for c in s.cases if c.id == "Nx3")
    good = OPS["tanh"]
    check_forward(s, case, "float64", 3)
    check_gradient(s, case)
    monkeypatch.setitem(OPS, "tanh", dataclasses.replace(
        good, vjp=lambda g, y, x: (ops.mul(good.vjp(g, y, x)[0], 1.00001),)))
    with pytest.raises(AssertionError, match="gradient of input"):
        check_gradient(s, case)
    monkeypatch.setitem(OPS, "tanh", dataclasses.replace(good, impl=lambda xp, x: xp.tanh(x) * (1 + 1e-8)))
    with pytest.raises(AssertionError, match=r"max\|diff\|"):
        check_forward(s, case, "float64", 3)
