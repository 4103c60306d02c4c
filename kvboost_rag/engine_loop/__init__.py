"""The engine loop: one thread owns the model and builds every forward pass from the running
answers' next tokens and slices of waiting prompt work (:mod:`kvboost_rag.engine_loop.loop`)."""

from kvboost_rag.engine_loop.budget import StepBudget
from kvboost_rag.engine_loop.loop import EngineLoop
from kvboost_rag.engine_loop.places import BatchPlaces, Reservation
from kvboost_rag.engine_loop.work import Admission, JoinDecode, PromptWork

__all__ = ["Admission", "BatchPlaces", "EngineLoop", "JoinDecode", "PromptWork", "Reservation", "StepBudget"]
