"""The live progress line: batches, throughput, elapsed time and ETA."""
import io

from minicavs.train.progress import Progress, duration


def test_duration():
    assert [duration(s) for s in (0, 0.4, 59.6, 75, 3599, 3725)] == ["0:00", "0:00", "1:00", "1:15", "59:59",
                                                                      "1:02:05"]


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_the_line_has_rate_elapsed_and_eta():
    bar = Progress(4, "epoch 2/5", "trees", every=0.0, stream=Tty())
    bar.start -= 30.0           # 30 s ago
    bar.done, bar.units = 1, 100
    line = bar.line(bar.start + 30.0, loss=1.23456)
    assert line == ("epoch 2/5 [######..................] 1/4 batches, 3 trees/s loss 1.235, 0:30 elapsed, "
                    "ETA 1:30")


def test_quiet_without_a_terminal():
    stream = io.StringIO()
    bar = Progress(2, "epoch 1", "trees", every=0.0, stream=stream)
    bar.update(5)
    bar.update(5)
    bar.close()
    assert stream.getvalue() == ""
