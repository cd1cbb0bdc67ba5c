"""How one weight version's bytes reach the engines: a `Transport` per file, chosen by name.

    transport = make_transport("broadcast", config)   # or "disk", "cuda_ipc"

Modules are imported only when asked for, so a CPU machine never imports a GPU-only backend;
asking for one whose requirements are missing raises ValueError naming them.
"""

from sync.transports.base import Transport, TransportConfig, available_transports, make_transport

__all__ = ["Transport", "TransportConfig", "available_transports", "make_transport"]
