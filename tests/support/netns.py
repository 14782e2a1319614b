"""Two Linux network namespaces joined by a veth pair: two hosts, as far as
their sockets can tell (the disaggregation and cluster security tests). Made
with iproute2's `ip`, which needs root; a test skips, saying why, where they
cannot be made."""

import contextlib
import json
import shutil
import subprocess
import sys

import pytest


def ip(*args: str) -> None:
    """`ip ARGS`; skips the test, saying why, when it fails."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"cannot set up network namespaces: `ip {' '.join(args)}` failed "
                    f"({result.returncode}): {result.stderr.strip()}")


class Link:
    """Two namespaces, `a` (10.213.0.1) and `b` (10.213.0.2), joined by a veth pair."""

    A_IP, B_IP = "10.213.0.1", "10.213.0.2"

    def __init__(self, tag: str):
        self.a, self.b = f"cmpl-a-{tag}", f"cmpl-b-{tag}"
        self.veth_a, self.veth_b = f"cmpla{tag}", f"cmplb{tag}"  # interface names: 15 characters at most

    def exec_in(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def rx_bytes(self) -> int:
        """Bytes namespace `a` has received over the link."""
        out = subprocess.run(["ip", "-n", self.a, "-j", "-s", "link", "show", "dev", self.veth_a],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        return json.loads(out)[0]["stats64"]["rx"]["bytes"]


@contextlib.contextmanager
def linked(tag: str, default_routes: bool = False):
    """Two namespaces joined by a veth pair (`Link`), deleted after; with
    `default_routes`, each one's default route over the link, as a machine
    has one. Skips the test, saying why, where they cannot be made."""
    if not sys.platform.startswith("linux"):
        pytest.skip("network namespaces are Linux's")
    if shutil.which("ip") is None:
        pytest.skip("cannot set up network namespaces: no `ip` command (iproute2 is not installed)")
    net = Link(tag)
    try:
        ip("netns", "add", net.a)
        ip("netns", "add", net.b)
        ip("link", "add", net.veth_a, "netns", net.a, "type", "veth", "peer", "name", net.veth_b, "netns", net.b)
        for ns, dev, addr in ((net.a, net.veth_a, net.A_IP), (net.b, net.veth_b, net.B_IP)):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", dev, "up")
        if default_routes:
            ip("-n", net.a, "route", "add", "default", "via", net.B_IP)
            ip("-n", net.b, "route", "add", "default", "via", net.A_IP)
        yield net
    finally:  # deleting a namespace deletes its end of the pair, and so the pair
        for ns in (net.a, net.b):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
