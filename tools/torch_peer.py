"""What the PyTorch peers share: the timed training loop and the one JSON line they print.

Imported by tools/torch_*.py, which run in the peers' own environment (tools/setup_peers.sh) and import
nothing from minicavs; the script's directory is on sys.path, so ``from torch_peer import ...`` works.
"""
import json
import time


def train_and_report(torch, params, loss_fn, batches, units: int, spec: dict, check_loss: float) -> None:
    """Adam over ``batches`` (argument tuples for ``loss_fn``) for one warm-up epoch and ``spec["epochs"]``
    timed ones; prints the check loss, ``units`` per second of each timed epoch, threads and version."""
    opt = torch.optim.Adam(params, lr=spec["lr"])
    rates = []
    for epoch in range(spec["epochs"] + 1):   # the first epoch warms up
        start = time.perf_counter()
        for args in batches:
            opt.zero_grad()
            loss = loss_fn(*args)
            loss.backward()
            opt.step()
        if epoch:
            rates.append(units / (time.perf_counter() - start))
    print(json.dumps({"check_loss": check_loss, "rates": rates, "threads": torch.get_num_threads(),
                      "torch": torch.__version__}))
