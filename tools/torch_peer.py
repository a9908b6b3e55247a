"""What the PyTorch peers share: threads, the optimizer and the step functions handed to the protocol of
tools/peer_common.py (documented in minicavs/bench/peers.py).

Imported by tools/torch_*.py, which run in the peers' own environment (tools/setup_peers.sh) and import
nothing from minicavs; the script's directory is on sys.path, so ``from torch_peer import ...`` works.

The spec's ``optimizer`` is minicavs' optimizer as ``{"name": "adam" | "sgd" | "adagrad", **hyper()}``
(lr, weight_decay, clip_norm, and beta1/beta2/eps, momentum or eps); without it, Adam with ``spec["lr"]``.
The update rules are the same as minicavs' (torch's Adam/SGD/Adagrad add L2 weight decay to the gradient,
SGD's momentum is v = m v + g); ``clip_norm`` clips the global gradient norm first. With minicavs'
``sparse_updates`` (lazy row updates of embeddings, as the bench trains), the peers look embeddings up with
``sparse=True`` and :class:`LazyRows` updates only the rows a batch looked up, with minicavs' rule (Adam's
bias correction from the global step, the other rows' moments untouched): the same work and the same result,
where a dense torch.optim.Adam would update the whole table every step.

With the spec's ``per_core``, the protocol runs twice in the process: with the spec's threads, then on one
intra-op thread (``torch.set_num_threads(1)``) over the same samples, reported under ``per_core``.

The spec's ``device`` (default ``cpu``; ``cuda``, ``cuda:1``) is where the peer's parameters and data live
and its work runs; on a GPU every clock read of the protocol comes after ``torch.cuda.synchronize()``.
"""
import os

from peer_common import measure, report


def set_threads(torch, spec: dict) -> int:
    """Intra-op threads: ``spec["threads"]`` or every core of the machine."""
    n = int(spec.get("threads") or os.cpu_count() or 1)
    torch.set_num_threads(n)
    return n


def device(torch, spec: dict):
    """The spec's ``device`` as a torch.device, checked to exist (a clear error, not a late CUDA one)."""
    dev = torch.device(spec.get("device") or "cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {dev}: this torch ({torch.__version__}) sees no CUDA device")
    return dev


def lazy_rows(spec: dict) -> bool:
    """Whether minicavs updates embedding rows lazily (its optimizer's ``sparse_updates``): the peer's
    lookups then pass ``sparse=True``, so their gradients are the rows looked up."""
    return bool((spec.get("optimizer") or {}).get("sparse_updates"))


class LazyRows:
    """minicavs' ``sparse_updates`` for the parameters whose gradient is sparse (embedding lookups): the
    looked-up rows (duplicates summed) and their slots are updated with minicavs' rule; other rows keep their
    value and slots. Adam's bias correction uses this optimizer's global step count."""

    def __init__(self, torch, params, o: dict):
        self.torch, self.params, self.o, self.t = torch, list(params), o, 0
        self.slots = [{k: torch.zeros_like(p) for k in ("m", "v", "momentum", "sum_sq")} for p in self.params]

    def step(self) -> None:
        self.t += 1
        for p, slots in zip(self.params, self.slots):
            if p.grad is not None:
                g = p.grad.coalesce()
                self._rows(p, g.indices()[0], g.values(), slots)

    def _rows(self, p, idx, g, slots) -> None:
        o, torch = self.o, self.torch
        with torch.no_grad():
            value = p[idx]
            if o.get("weight_decay"):
                g = g + o["weight_decay"] * value
            name = o["name"].lower()
            if name == "adam":
                b1, b2 = o.get("beta1", 0.9), o.get("beta2", 0.999)
                root = (1.0 - b2 ** self.t) ** 0.5
                lr_t, eps_t = o["lr"] * root / (1.0 - b1 ** self.t), o.get("eps", 1e-8) * root
                m = b1 * slots["m"][idx] + (1.0 - b1) * g
                v = b2 * slots["v"][idx] + (1.0 - b2) * (g * g)
                slots["m"][idx], slots["v"][idx] = m, v
                p[idx] = value - lr_t * m / (v.sqrt() + eps_t)
            elif name == "sgd":
                if o.get("momentum"):
                    g = o["momentum"] * slots["momentum"][idx] + g
                    slots["momentum"][idx] = g
                p[idx] = value - o["lr"] * g
            else:   # adagrad
                acc = slots["sum_sq"][idx] + g * g
                slots["sum_sq"][idx] = acc
                p[idx] = value - o["lr"] * g / (acc.sqrt() + o.get("eps", 1e-10))


def make_optimizer(torch, params, spec: dict):
    o = dict(spec.get("optimizer") or {"name": "adam", "lr": spec["lr"]})
    name, lr, wd = o["name"].lower(), o["lr"], o.get("weight_decay", 0.0)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(o.get("beta1", 0.9), o.get("beta2", 0.999)),
                                eps=o.get("eps", 1e-8), weight_decay=wd)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=o.get("momentum", 0.0), weight_decay=wd)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, eps=o.get("eps", 1e-10), weight_decay=wd)
    raise ValueError(f"optimizer {name!r}: the PyTorch peers know adam, sgd, adagrad")


def check_loss(torch, loss_fn, *args) -> float:
    """The loss of the check samples for the weights as handed over (no gradient, no update)."""
    with torch.no_grad():
        return float(loss_fn(*args))


def clip(torch, params, max_norm) -> None:
    """minicavs' clipping: when the global norm of every gradient (sparse ones by their rows) exceeds
    ``max_norm``, every gradient is scaled by max_norm / norm (torch's clip_grad_norm_ adds 1e-6 and takes
    no sparse gradient)."""
    grads = [p.grad.coalesce() if p.grad.is_sparse else p.grad for p in params if p.grad is not None]
    norm = float(sum(float((g.values() if g.is_sparse else g).double().pow(2).sum()) for g in grads)) ** 0.5
    if norm > max_norm:
        for p in params:
            if p.grad is not None:
                p.grad = p.grad * (max_norm / norm)


def train_and_report(torch, params, loss_fn, make, units, spec: dict, check: float, sparse=(),
                     named=None) -> None:
    """The protocol (tools/peer_common.py) over the samples (``units[i]`` trees or words in sample i;
    ``make(i, j)`` the argument tuple of ``loss_fn`` for samples i..j-1): forward, backward and the spec's
    optimizer per batch (:class:`LazyRows` for the parameters in ``sparse``, looked up with sparse
    gradients); forward under ``torch.no_grad()`` for inference. Prints the JSON line. With the spec's
    ``steps_to`` (a path), only the spec's ``steps`` training steps on the first batches run, then
    ``named`` (minicavs' name -> a function giving that parameter in minicavs' layout) is saved there: the
    test that the peer's update equals minicavs'."""
    params = list(params)
    lazy = {id(p) for p in sparse}
    opt = make_optimizer(torch, [p for p in params if id(p) not in lazy], spec)
    rows = LazyRows(torch, sparse, dict(spec.get("optimizer") or {"name": "adam", "lr": spec["lr"]}))
    max_norm = (spec.get("optimizer") or {}).get("clip_norm")

    def train(args):
        opt.zero_grad()
        for p in rows.params:
            p.grad = None
        loss_fn(*args).backward()
        if max_norm:
            clip(torch, params, max_norm)
        opt.step()
        rows.step()

    def infer(args):
        with torch.no_grad():
            loss_fn(*args)

    if spec.get("steps_to"):
        return _steps(torch, train, make, len(units), spec, named)
    dev = device(torch, spec)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    timing = measure(spec, units, make, train, infer, sync)
    timing["threads"] = torch.get_num_threads()
    if spec.get("per_core"):   # then on one intra-op thread, same samples, this process (one start-up)
        torch.set_num_threads(1)
        timing["per_core"] = {**measure(spec, units, make, train, infer, sync), "threads": torch.get_num_threads()}
    extra = {"gpu": torch.cuda.get_device_name(dev)} if dev.type == "cuda" else {}
    report(spec, check, timing, framework="pytorch",
           optimizer=type(opt).__name__ + (" + LazyRows" if rows.params else ""),
           versions={"torch": torch.__version__}, device=str(dev), **extra)


def _steps(torch, train, make, n: int, spec: dict, named) -> None:
    """``spec["steps"]`` training steps on the first batches, then the parameters in minicavs' names."""
    import numpy as np
    bs = spec["batch"]
    for k in range(spec["steps"]):
        train(make(k * bs, min((k + 1) * bs, n)))
    with torch.no_grad():
        np.savez(spec["steps_to"], **{k: f().detach().cpu().numpy() for k, f in named.items()})
