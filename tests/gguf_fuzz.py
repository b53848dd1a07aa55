"""A seeded GGUF mutator and the loop that feeds mutants to what reads a user's file first: the
reader, the family's config and tensor checks, and the tokenizer. Run in a process of its own
(`python tests/gguf_fuzz.py COUNT SEED FILE...`) so its peak memory is its own; prints a JSON report."""

import json
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np

INTERESTING = [0, 1, 2, 7, 0x7F, 0xFF, 0x7FFF, 0xFFFF, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 62,
               2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1]


def mutate(raw: bytes, rng, header_end: int) -> bytes:
    """One to three changes, four in five inside the metadata and tensor infos (where a change
    changes what the file says rather than a weight's value)."""
    data = bytearray(raw)
    for _ in range(int(rng.integers(1, 4))):
        end = header_end if rng.random() < 0.8 else len(data)
        at = int(rng.integers(0, max(1, min(end, len(data)))))
        kind = int(rng.integers(7))
        if kind == 0:
            data[at] ^= 1 << int(rng.integers(8))
        elif kind == 1:
            data[at] = int(rng.integers(256))
        elif kind == 2:
            v = INTERESTING[int(rng.integers(len(INTERESTING)))]
            width = (1, 2, 4, 8)[int(rng.integers(4))]
            data[at:at + width] = (v & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
        elif kind == 3:
            del data[at:at + int(rng.integers(1, 64))]
        elif kind == 4:
            data[at:at] = bytes(rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8))
        elif kind == 5:
            span = int(rng.integers(1, 64))
            data[at:at] = data[at:at + span]   # a duplicated run: shifts everything after it
        else:
            del data[at:]
    return bytes(data)


def header_end(path: Path) -> int:
    from gguf import GGUFReader

    return min(t.data_offset for t in GGUFReader(path).tensors)


def read_as_a_user_would(path: Path) -> None:
    from ds4tvm.families import load_model
    from ds4tvm.gguf import open_gguf
    from ds4tvm.runtime.tokenizer import Tokenizer

    f = open_gguf(path)
    load_model(f)
    Tokenizer.from_gguf(f)


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def run(count: int, seed: int, sources: list[Path], work: Path) -> dict:
    from ds4tvm.errors import Ds4Error

    rng = np.random.default_rng(seed)
    bases = [(p.read_bytes(), header_end(p)) for p in sources]
    for p in sources:   # the sources themselves are valid
        read_as_a_user_would(p)
    signal.signal(signal.SIGALRM, _alarm)
    _reset_peak_rss()
    report = {"mutants": 0, "refused": 0, "accepted": 0, "hangs": 0, "others": [], "slowest_s": 0.0}
    target = work / "mutant.gguf"
    for i in range(count):
        raw, end = bases[i % len(bases)]
        target.write_bytes(mutate(raw, rng, end))
        t = time.perf_counter()
        signal.alarm(20)
        try:
            read_as_a_user_would(target)
            report["accepted"] += 1
        except Ds4Error as e:
            report["refused"] += 1
            if "\n" in e.message:
                report["others"].append(f"mutant {i}: a message of several lines: {e.message[:300]!r}")
        except _Hang:
            report["hangs"] += 1
        except BaseException as e:  # noqa: BLE001 - what the fuzzer is here to find
            report["others"].append(f"mutant {i}: {type(e).__name__}: {str(e)[:200]} at "
                                    f"{traceback.extract_tb(e.__traceback__)[-1]}")
        finally:
            signal.alarm(0)
        report["slowest_s"] = max(report["slowest_s"], time.perf_counter() - t)
        report["mutants"] += 1
    report["peak_rss_mib"] = _peak_rss_kib() / 1024
    return report


def _reset_peak_rss() -> None:
    """Linux keeps a process's peak RSS across exec, so it would start at what the forking test
    worker held (1.5 GB after its compiles): reset it to this process's own."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


if __name__ == "__main__":
    n, s, *files = sys.argv[1:]
    paths = [Path(f) for f in files]
    print(json.dumps(run(int(n), int(s), paths, paths[0].parent)))
