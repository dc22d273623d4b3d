"""Helper of the multi-rank tests: a port for one test's torch.distributed rendezvous."""

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the kernel had free a moment ago (bound to port 0, then released): the
    ``MASTER_PORT`` of one test's gloo ranks, so concurrent tests do not meet on a fixed one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
