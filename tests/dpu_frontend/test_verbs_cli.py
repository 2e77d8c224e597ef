"""`--transport verbs` on both command lines: flags, bad addresses, and the one-line answer on a
machine without an RDMA device."""
from __future__ import annotations

import argparse
import glob
import subprocess
import sys

import pytest

from dpu_frontend.transport import verbs
from shared_layout.rdma.device import NO_DEVICE_MESSAGE
from gpu_backend import rdma_server

HAS_DEVICE = bool(glob.glob("/sys/class/infiniband/*"))
no_device_only = pytest.mark.skipif(HAS_DEVICE, reason="this machine has an RDMA device")


def _frontend(*argv):
    p = argparse.ArgumentParser()
    verbs.add_arguments(p)
    return p.parse_args(list(argv))


def _daemon(*argv):
    p = argparse.ArgumentParser()
    rdma_server.add_arguments(p)
    return p.parse_args(list(argv))


def test_shm_is_the_default_and_needs_nothing():
    assert verbs.config_from_args(_frontend()) is None
    assert verbs.transport_factory_from_args(_frontend("--transport", "shm")) is None
    assert rdma_server.config_from_args(_daemon()) is None


def test_an_existing_transport_flag_is_kept():
    p = argparse.ArgumentParser()
    p.add_argument("--transport", choices=("shm", "verbs", "other"), default="shm")
    verbs.add_arguments(p)
    rdma_server.add_arguments(argparse.ArgumentParser())
    assert p.parse_args(["--transport", "other", "--daemon", "h:1"]).daemon == "h:1"


@pytest.mark.parametrize("argv, message", [
    (("--transport", "verbs"), "--transport verbs needs --daemon HOST:PORT"),
    (("--transport", "verbs", "--daemon", "gpu:0"), "--daemon: bad port"),
    (("--transport", "verbs", "--daemon", "fe80::1"), "--daemon: bad daemon address"),
])
def test_frontend_flag_errors(argv, message):
    with pytest.raises(SystemExit, match=message):
        verbs.config_from_args(_frontend(*argv))


def test_daemon_flag_errors():
    with pytest.raises(SystemExit, match="--rdma-listen: bad port"):
        rdma_server.config_from_args(_daemon("--transport", "verbs", "--rdma-listen", "0.0.0.0:99999"))


@no_device_only
def test_no_rdma_device_is_one_line_on_both_sides():
    with pytest.raises(SystemExit) as e:
        verbs.config_from_args(_frontend("--transport", "verbs", "--daemon", "10.0.0.2"))
    assert str(e.value) == NO_DEVICE_MESSAGE
    with pytest.raises(SystemExit) as e:
        rdma_server.config_from_args(_daemon("--transport", "verbs"))
    assert str(e.value) == f"blink gpu-daemon: {NO_DEVICE_MESSAGE}"


@no_device_only
def test_no_rdma_device_from_a_process_prints_one_line_and_no_traceback():
    code = ("import argparse, sys; from dpu_frontend.transport import verbs; p = argparse.ArgumentParser(); "
            "verbs.add_arguments(p); verbs.transport_factory_from_args(p.parse_args(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", code, "--transport", "verbs", "--daemon", "10.0.0.2:7470"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.splitlines() == [NO_DEVICE_MESSAGE]


def test_a_factory_defers_connecting_until_called():
    cfg = verbs.VerbsConfig(host="10.0.0.2", port=7470)
    factory = verbs.verbs_factory(cfg)
    assert callable(factory)   # nothing is opened until RingClient calls it
    with pytest.raises(ValueError):
        verbs.VerbsConfig(host="")


@no_device_only
def test_connecting_without_a_device_raises_the_transport_error_ring_client_handles():
    from shared_layout.errors import TransportError
    from shared_layout.rdma.device import NoRdmaDevice
    with pytest.raises(NoRdmaDevice) as e:
        verbs.VerbsTransport.connect(verbs.VerbsConfig(host="127.0.0.1", port=7470))
    assert isinstance(e.value, TransportError) and str(e.value) == NO_DEVICE_MESSAGE
