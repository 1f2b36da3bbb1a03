"""The simulated engine: a cost model of a GPU server in virtual time (capacity planning, bench)."""

from .hardware import HardwareModel
from .server import SimRequest, SimulatedServer

__all__ = ["HardwareModel", "SimRequest", "SimulatedServer"]
