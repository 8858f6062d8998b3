"""Sending out of a shared mapping with no copy on the sender's CPU (Linux): ``vmsplice`` the
mapping's pages into a pipe, ``splice`` the pipe into a TCP socket. The socket's frames then
reference the mapping's pages until the receiver has read them (on loopback the receiver's
``recv`` is the only copy), so the sender must not change those bytes before the receiver
says it has read them. Python's ``os`` has ``splice`` but not ``vmsplice``: libc's, through
ctypes."""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import mmap
import os
from pathlib import Path

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
PIPE_MAX_SIZE = Path("/proc/sys/fs/pipe-max-size")
#: at most this many iovecs per ``vmsplice`` (the kernel's cap is IOV_MAX, 1024)
IOVECS = 64


class IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_vmsplice = _libc.vmsplice
_vmsplice.argtypes = [ctypes.c_int, ctypes.POINTER(IOVec), ctypes.c_size_t, ctypes.c_uint]
_vmsplice.restype = ctypes.c_ssize_t


def vmsplice(fd: int, spans: list[tuple[int, int]]) -> int:
    """``vmsplice(2)`` of the (address, length) ``spans`` into the pipe ``fd`` (flags 0: the
    pipe references the pages, nothing is gifted); returns the bytes taken (fewer once the
    pipe is full); OSError on failure."""
    iov = (IOVec * len(spans))(*(IOVec(a, n) for a, n in spans))
    got = _vmsplice(fd, iov, len(spans), 0)
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"vmsplice: {os.strerror(err)}")
    return int(got)


def address(m: mmap.mmap) -> int:
    """The address of a writable mapping's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


class SpliceSender:
    """Sends spans of memory into a blocking socket ``sock_fd`` through a pipe as large as
    ``/proc/sys/fs/pipe-max-size`` allows (its size: ``pipe_bytes``). Close it when done."""

    def __init__(self, sock_fd: int) -> None:
        self.sock_fd = sock_fd
        self.r, self.w = os.pipe()
        try:
            want = int(PIPE_MAX_SIZE.read_text())
        except (OSError, ValueError):
            want = 1 << 20
        self.pipe_bytes = fcntl.fcntl(self.w, F_SETPIPE_SZ, want)

    def send(self, spans: list[tuple[int, int]]) -> int:
        """Every byte of ``spans`` (address, length) into the socket, in order: the pipe filled
        by ``vmsplice``, then emptied into the socket by ``splice``, again. Returns the bytes."""
        left = [s for s in spans if s[1]]
        total = 0
        while left:
            taken = in_pipe = vmsplice(self.w, left[:IOVECS])
            total += taken
            while left and taken >= left[0][1]:
                taken -= left.pop(0)[1]
            if left and taken:
                left[0] = (left[0][0] + taken, left[0][1] - taken)
            while in_pipe:
                more = os.SPLICE_F_MORE if left else 0  # more bytes follow this call's
                moved = os.splice(self.r, self.sock_fd, in_pipe, flags=more)
                if moved == 0:
                    raise ConnectionError("splice: the socket took nothing")
                in_pipe -= moved
        return total

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)
