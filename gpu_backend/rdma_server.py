"""The daemon's side of the verbs transport: register the ring, connect frontends to it.

    RdmaRingServer.open(config)       pick the RDMA port (one-line error without one)
      .register_host_ring(buf)        MR over the host ring (shm mmap / host-mapped memory)
      .register_gpu_ring(dptr, n)     GPUDirect checks -> dma-buf MR over device memory
      .serve()                        TCP bootstrap thread: per frontend, read its hello,
                                      create an RC QP, move it to RTS, reply with QPN/GID/
                                      LID/PSN + rkey/address/length/layout version
      frontend socket EOF             -> that frontend's QP is destroyed
      .close()

After the exchange the daemon does nothing per request: frontends READ and
WRITE the ring one-sided and the executor keeps polling it as it does on one
machine. The ring's memory region allows remote READ and WRITE only (no remote
atomics, no relaxed ordering). `flush_before_read()` is the one hook an
executor may need: on a GPU without GPUDirect write ordering, a host-side
consumer calls it after it sees a new state word and before it reads the payload.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import threading

from shared_layout.errors import TransportError
from shared_layout.rdma.bootstrap import (DEFAULT_PORT, BootstrapError, RingRegion, ServerHello,
                                                    decode_client_hello, encode_error, encode_server_hello,
                                                    keepalive, parse_endpoint, read_line)

from . import rdma_gpudirect as gd

log = logging.getLogger("blink.rdma")


@dataclasses.dataclass(frozen=True)
class RdmaServerConfig:
    listen_host: str = "0.0.0.0"
    listen_port: int = DEFAULT_PORT
    device: str | None = None          # None: the first active RDMA port
    ib_port: int | None = None
    gid_index: int | None = None       # None: RoCE v2 IPv4-mapped GID, or 0 on InfiniBand
    max_frontends: int = 4             # QPs served at once (one per attached frontend)
    handshake_timeout_s: float = 5.0
    max_dest_rd_atomic: int = 16       # RDMA READs each frontend may keep in flight

    def __post_init__(self):
        if not 0 <= self.listen_port < 65536:
            raise ValueError(f"listen port {self.listen_port} outside 0..65535")
        if self.max_frontends < 1 or self.max_dest_rd_atomic < 1 or self.handshake_timeout_s <= 0:
            raise ValueError("max_frontends, max_dest_rd_atomic and handshake_timeout_s must be positive")


@dataclasses.dataclass(eq=False)
class _Frontend:
    sock: socket.socket
    peer: str
    qp: object = None


class RdmaRingServer:
    def __init__(self, config: RdmaServerConfig, vport):
        self.config = config
        self.vport = vport
        self.region: RingRegion | None = None
        self.placement: gd.RingPlacement | None = None
        self._mr = self._anchor = None
        self._dmabuf_fd = -1
        self._listener: socket.socket | None = None
        self._frontends: set[_Frontend] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @classmethod
    def open(cls, config: RdmaServerConfig) -> "RdmaRingServer":
        """Open the RDMA port; NoRdmaDevice (a TransportError) when this machine has none."""
        from shared_layout.rdma.device import VerbsPort, pick_port, scan_ports
        port = pick_port(scan_ports(), config.device, config.ib_port)
        return cls(config, VerbsPort(port, config.gid_index))

    # -- registration ---------------------------------------------------------------
    def register_host_ring(self, buf, nbytes: int | None = None) -> RingRegion:
        """Register a ring in host memory (the shm mmap, or host-mapped CUDA memory)."""
        from shared_layout.rdma.device import buffer_address
        addr, anchor = buffer_address(buf)
        nbytes = len(memoryview(buf).cast("B")) if nbytes is None else nbytes
        self._mr = self.vport.register(addr, nbytes, remote=True)
        self._anchor = anchor   # pins the buffer export while the MR lives
        self.placement = gd.RingPlacement("host", False, "ring in host memory")
        self.region = RingRegion(rkey=int(self._mr.rkey), addr=addr, length=nbytes, placement="host")
        return self.region

    def register_gpu_ring(self, device_ptr: int, nbytes: int, consumer: str = "device",
                          device_ordinal: int = 0) -> RingRegion:
        """Register a ring in GPU memory (cuMemAlloc'd, caller's CUDA context current).

        GpuDirectError when this GPU may not hold an RDMA-written ring for this
        consumer; `gpu_placement()` tells that before the ring is allocated.
        """
        placement = self.gpu_placement(consumer, device_ordinal)
        if placement.where != "gpu":
            raise gd.GpuDirectError(f"ring must stay in host-mapped memory: {placement.reason}")
        fd, length = gd.export_dmabuf(device_ptr, nbytes)
        try:
            self._mr = self.vport.register_dmabuf(fd, length)
        except BaseException:
            os.close(fd)
            raise
        self._dmabuf_fd = fd
        self.placement = placement
        # a dma-buf MR is addressed by IOVA, which rdma-core sets to the dma-buf offset (0)
        self.region = RingRegion(rkey=int(self._mr.rkey), addr=0, length=nbytes, placement="gpu")
        log.info("ring in GPU memory registered as a dma-buf MR (%s)", placement.reason)
        return self.region

    @staticmethod
    def gpu_placement(consumer: str = "device", device_ordinal: int = 0) -> gd.RingPlacement:
        return gd.plan_placement(gd.query_caps(device_ordinal), consumer)

    def flush_before_read(self) -> None:
        """Make RDMA writes visible to the GPU before reading a payload (no-op unless required)."""
        if self.placement is not None and self.placement.flush_before_read:
            gd.flush_writes()

    # -- bootstrap --------------------------------------------------------------------
    def serve(self) -> tuple[str, int]:
        """Listen for frontends in a background thread; returns the bound address."""
        if self.region is None:
            raise RuntimeError("register the ring before serving frontends")
        host = self.config.listen_host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, self.config.listen_port))
        except OSError as e:
            sock.close()
            raise TransportError(f"cannot listen on {host}:{self.config.listen_port} for RDMA "
                                 f"bootstrap: {e.strerror or e}") from None
        sock.listen(16)
        self._listener = sock
        self._spawn(self._accept_loop, "rdma-accept")
        bound = sock.getsockname()[:2]
        log.info("RDMA bootstrap on %s:%d (%s, ring in %s memory, %d bytes)", bound[0], bound[1],
                 getattr(self.vport, "port", "no device"), self.region.placement, self.region.length)
        return bound

    @property
    def frontends(self) -> int:
        with self._lock:
            return sum(1 for f in self._frontends if f.qp is not None)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return   # listener closed
            self._spawn(self._serve_frontend, "rdma-frontend", conn, f"{addr[0]}:{addr[1]}")

    def _serve_frontend(self, conn: socket.socket, peer: str) -> None:
        fe = _Frontend(conn, peer)
        with self._lock:
            self._frontends.add(fe)
        try:
            keepalive(conn)
            try:
                hello = decode_client_hello(read_line(conn, self.config.handshake_timeout_s, f"frontend {peer}"))
            except BootstrapError as e:
                log.warning("frontend %s: %s", peer, e)
                _send_quietly(conn, encode_error(str(e)))
                return
            with self._lock:
                busy = sum(1 for f in self._frontends if f.qp is not None) >= self.config.max_frontends
            if busy:
                msg = f"the daemon already serves {self.config.max_frontends} frontends"
                log.warning("frontend %s refused: %s", peer, msg)
                _send_quietly(conn, encode_error(msg))
                return
            try:
                reply = self._connect_qp(fe, hello)
            except TransportError as e:
                log.warning("frontend %s: %s", peer, e)
                _send_quietly(conn, encode_error(str(e)))
                return
            except Exception as e:   # a bug here must not kill the bootstrap thread silently
                log.exception("frontend %s: cannot connect a queue pair", peer)
                _send_quietly(conn, encode_error(f"daemon error while connecting: {e!r}"))
                return
            conn.sendall(encode_server_hello(reply))
            log.info("frontend %s connected (QPN %#x -> our QPN %#x)", peer, hello.qp.qpn, reply.qp.qpn)
            conn.settimeout(None)
            while conn.recv(4096):   # the frontend never sends more; EOF (or reset) means it left
                pass
            log.info("frontend %s disconnected", peer)
        except OSError as e:
            log.info("frontend %s gone: %s", peer, e)
        finally:
            with self._lock:
                self._frontends.discard(fe)
            if fe.qp is not None:
                fe.qp.close()
            conn.close()

    def _connect_qp(self, fe: _Frontend, hello) -> ServerHello:
        from shared_layout.rdma.device import RcQueuePair
        rd = max(1, min(hello.max_rd_atomic or 1, self.config.max_dest_rd_atomic, self.vport.max_qp_rd_atom or 1))
        qp = RcQueuePair(self.vport, sq_depth=4, inline_bytes=0, responder=True)
        try:
            qp.connect(hello.qp, max_rd_atomic=1, max_dest_rd_atomic=rd)
        except BaseException:
            qp.close()
            raise
        fe.qp = qp
        return ServerHello(qp.address(), max_dest_rd_atomic=rd, ring=self.region)

    def _spawn(self, target, name: str, *args) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def close(self) -> None:
        """Disconnect every frontend, deregister the ring, release the device. Idempotent."""
        self._stop.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)   # wakes the accept() blocked in its thread
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        with self._lock:
            fronts = list(self._frontends)
        for fe in fronts:
            try:
                fe.sock.shutdown(socket.SHUT_RDWR)   # wakes its thread, which destroys the QP
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=2.0)
        self._threads.clear()
        if self._mr is not None:
            self._mr.close()
            self._mr = None
        self._anchor = None
        if self._dmabuf_fd >= 0:
            os.close(self._dmabuf_fd)
            self._dmabuf_fd = -1
        self.vport.close()


def _send_quietly(conn: socket.socket, data: bytes) -> None:
    try:
        conn.sendall(data)
    except OSError:
        pass


# -- command line (hooks for `blink gpu-daemon`) ------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--transport shm|verbs` and the RDMA options of the daemon."""
    try:
        parser.add_argument("--transport", choices=("shm", "verbs"), default="shm",
                            help="shm: frontends on this machine map the ring; verbs: frontends on "
                                 "other machines (a BlueField) reach it with RDMA")
    except argparse.ArgumentError:
        pass   # the caller already offers --transport
    g = parser.add_argument_group("RDMA (--transport verbs)")
    g.add_argument("--rdma-listen", metavar="HOST:PORT", default=f"0.0.0.0:{DEFAULT_PORT}",
                   help=f"TCP address frontends bootstrap their RDMA connection at (default 0.0.0.0:{DEFAULT_PORT})")
    g.add_argument("--rdma-device", default=None, help="RDMA device, e.g. mlx5_0 (default: first active)")
    g.add_argument("--rdma-port", type=int, default=None, help="port of that device (default: first active)")
    g.add_argument("--rdma-gid-index", type=int, default=None,
                   help="GID index (default: a RoCE v2 IPv4 GID, or 0 on InfiniBand)")
    g.add_argument("--rdma-max-frontends", type=int, default=4, help="frontends served at once")


def config_from_args(args: argparse.Namespace) -> RdmaServerConfig | None:
    """The RDMA config the flags ask for, or None for --transport shm.

    Exits with one line (no traceback) on a bad address or when this machine
    has no RDMA device, before the model is loaded.
    """
    if getattr(args, "transport", "shm") != "verbs":
        return None
    try:
        host, port = parse_endpoint(args.rdma_listen)
        config = RdmaServerConfig(listen_host=host, listen_port=port, device=args.rdma_device,
                                  ib_port=args.rdma_port, gid_index=args.rdma_gid_index,
                                  max_frontends=args.rdma_max_frontends)
    except ValueError as e:
        raise SystemExit(f"blink gpu-daemon: --rdma-listen: {e}") from None
    from shared_layout.rdma.device import import_pyverbs, pick_port, scan_ports
    try:
        pick_port(scan_ports(), config.device, config.ib_port)
        import_pyverbs()
    except TransportError as e:
        raise SystemExit(f"blink gpu-daemon: {e}") from None
    return config


def serve_host_ring(config: RdmaServerConfig, buf, nbytes: int | None = None) -> RdmaRingServer:
    """Open the port, register the host ring `buf`, start the bootstrap; one-line exit on failure."""
    server = None
    try:
        server = RdmaRingServer.open(config)
        server.register_host_ring(buf, nbytes)
        server.serve()
    except (TransportError, gd.GpuDirectError) as e:
        if server is not None:
            server.close()
        raise SystemExit(f"blink gpu-daemon: {e}") from None
    return server


def serve_gpu_ring(config: RdmaServerConfig, device_ptr: int, nbytes: int, consumer: str = "device",
                   device_ordinal: int = 0) -> RdmaRingServer:
    """Same for a ring in GPU memory (see RdmaRingServer.register_gpu_ring)."""
    server = None
    try:
        server = RdmaRingServer.open(config)
        server.register_gpu_ring(device_ptr, nbytes, consumer, device_ordinal)
        server.serve()
    except (TransportError, gd.GpuDirectError) as e:
        if server is not None:
            server.close()
        raise SystemExit(f"blink gpu-daemon: {e}") from None
    return server
