"""`sync.group.address_for`: the address engines on other hosts use to reach the sync source."""

import socket

from sync.group import address_for


def test_local_engines_get_loopback():
    assert address_for(["127.0.0.1", "localhost", "::1"]) == "127.0.0.1"


def test_remote_engines_get_an_address_of_this_host_on_their_route():
    remote = "192.0.2.200"  # TEST-NET-1: routed, never answered; nothing is sent to it
    address = address_for(["127.0.0.1", remote])
    assert not address.startswith("127.")
    with socket.socket() as sock:
        sock.bind((address, 0))  # an address of this host: the sync TCPStore can listen on it


def test_the_rendezvous_store_listens_only_on_master_address():
    import pytest

    from sync.group import host_store

    store = host_store("127.0.0.1", world_size=2, timeout_s=10)
    other = address_for(["192.0.2.200"])  # this host's non-loopback address
    with pytest.raises(OSError):  # torch's own store would accept this connection
        socket.create_connection((other, store.port), timeout=2).close()
    socket.create_connection(("127.0.0.1", store.port), timeout=2).close()
    del store
