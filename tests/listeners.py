"""What a process tree listens on: its TCP listening sockets and their addresses, read from /proc (Linux).

    with Listeners(os.getpid()) as seen:      # samples the tree every 0.1 s while the block runs
        ...
    seen.found   # {(pid, program, address, port)}
"""
from __future__ import annotations

import ipaddress
import os
import threading


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def process_tree(root: int) -> list[int]:
    todo, seen = [root], []
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo += _children(pid)
    return seen


def _address(hex_addr: str) -> tuple[str, int]:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    if len(raw) == 4:
        ip = ipaddress.IPv4Address(raw[::-1])
    else:   # four little-endian 32-bit words
        ip = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return str(ip), int(port_hex, 16)


def listening(root: int) -> set[tuple[int, str, str, int]]:
    """(pid, program, address, port) of every listening TCP socket held by `root` and its descendants."""
    inodes: dict[str, tuple[int, str]] = {}
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                program = " ".join(a.decode(errors="replace") for a in f.read().split(b"\0")[:4])
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = (pid, program)
        except OSError:
            continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:          # 0A: LISTEN
                    found.add((*inodes[cols[9]], *_address(cols[1])))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None
                              and ip.ipv4_mapped.is_loopback)


class Listeners:
    """Samples `listening(root)` on a thread while the block runs; `found` is the union of the samples."""

    def __init__(self, root: int, every_s: float = 0.1) -> None:
        self.root, self.every_s, self.found = root, every_s, set()
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.found |= listening(self.root)

    def __enter__(self) -> "Listeners":
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.found |= listening(self.root)

    def exposed(self) -> list[tuple[int, str, str, int]]:
        """The listeners bound beyond loopback (0.0.0.0, ::, or a real interface)."""
        return sorted(x for x in self.found if not is_loopback(x[2]))
