"""Admission: decides when a request enters the engine (warm first, cold capped, cold shed)."""

from .config import POLICIES, AdmissionConfig
from .controller import AdmissionController
from .gate import RankGate
from .policy import AdmissionPolicy, RequestClass, Ticket
from .rate import PrefillRateEstimator

__all__ = [
    "POLICIES",
    "AdmissionConfig",
    "AdmissionController",
    "AdmissionPolicy",
    "PrefillRateEstimator",
    "RankGate",
    "RequestClass",
    "Ticket",
]
