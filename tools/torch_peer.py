"""What the PyTorch peers share: threads, the optimizer and the step functions handed to the protocol of
tools/peer_common.py (documented in minicavs/bench/peers.py).

Imported by tools/torch_*.py, which run in the peers' own environment (tools/setup_peers.sh) and import
nothing from minicavs; the script's directory is on sys.path, so ``from torch_peer import ...`` works.

The spec's ``optimizer`` is minicavs' optimizer as ``{"name": "adam" | "sgd" | "adagrad", **hyper()}``
(lr, weight_decay, clip_norm, and beta1/beta2/eps, momentum or eps); without it, Adam with ``spec["lr"]``.
The update rules are the same as minicavs' (torch's Adam/SGD/Adagrad add L2 weight decay to the gradient,
SGD's momentum is v = m v + g); ``clip_norm`` clips the global gradient norm first. minicavs'
``sparse_updates`` (lazy row updates of embeddings) has no counterpart here: PyTorch updates densely.

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


def train_and_report(torch, params, loss_fn, make, units, spec: dict, check: float) -> None:
    """The protocol (tools/peer_common.py) over the samples (``units[i]`` trees or words in sample i;
    ``make(i, j)`` the argument tuple of ``loss_fn`` for samples i..j-1): forward, backward and the spec's
    optimizer per batch; forward under ``torch.no_grad()`` for inference. Prints the JSON line."""
    params = list(params)
    opt = make_optimizer(torch, params, spec)
    clip = (spec.get("optimizer") or {}).get("clip_norm")

    def train(args):
        opt.zero_grad()
        loss_fn(*args).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()

    def infer(args):
        with torch.no_grad():
            loss_fn(*args)

    dev = device(torch, spec)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    timing = measure(spec, units, make, train, infer, sync)
    extra = {"gpu": torch.cuda.get_device_name(dev)} if dev.type == "cuda" else {}
    report(spec, check, timing, framework="pytorch", threads=torch.get_num_threads(),
           optimizer=type(opt).__name__, versions={"torch": torch.__version__}, device=str(dev), **extra)
