"""The Leto exception hierarchy.

Every error a user can cause or meet names the problem and says what to do. The CLI turns
a ``LetoError`` into one line on stderr and a non-zero exit code; anything else is a bug.
"""

from __future__ import annotations


class LetoError(Exception):
    """Base class of every error Leto raises on purpose."""


class ConfigError(LetoError):
    """A job file, scenario file or flag is malformed, unknown or out of range."""


class ScriptError(ConfigError):
    """The training script breaks the step's contract with Leto (a retained gradient unset
    or written by hand, the optimizer stepped outside ``state.step()``, a step without
    ``state.step()``). The same happens on every run, so like a ``ConfigError`` it ends the
    job in one line, without restarts."""


class ProtocolError(LetoError):
    """A peer (state manager, agent, trainer) broke the wire protocol or a state machine."""


class StoreLostError(ProtocolError):
    """The job's c10d store (hosted by another node's agent) stopped answering."""

    def __init__(self, where: str, cause: BaseException | str) -> None:
        super().__init__(
            f"lost the job's store at {where} ({' '.join(str(cause).split())[:200]}); "
            "the agent of another node (the one hosting the store) has probably died — "
            "this node stops too; restart the job"
        )


class PoolError(LetoError):
    """The state manager refused a request (bad name, size mismatch on reattach, ...)."""


class UnrecoverableStateError(LetoError):
    """Retained state cannot be brought back exactly; the job must take the checkpoint path."""


class InvalidTransitionError(ProtocolError):
    """A state machine was asked to make a transition its table does not allow."""
