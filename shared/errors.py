"""Named exceptions. ``permanent`` says whether retrying the same input can ever succeed."""

from __future__ import annotations


class DraftlineError(Exception):
    """Base of every error draftline raises on purpose."""

    permanent = True


class SettingsError(DraftlineError):
    """A required setting is missing or invalid."""


class UnknownSetting(SettingsError):
    """A ``DRAFTLINE_`` variable that no draftline component reads (most often a misspelt name) is set."""


class DatasetError(DraftlineError):
    """A dataset cannot be read at all (missing file, unknown format, unreachable repo)."""


class RowError(DraftlineError):
    """One dataset row is malformed; only that row fails."""


class PromptTooLong(RowError):
    """The prompt does not fit the target's context window."""


class ReplyTooShort(DraftlineError):
    """The target's reply has fewer tokens than the run's ``min_completion_tokens``."""


class ChatTemplateError(DraftlineError):
    """The chat template renders the prompt and the conversation inconsistently."""


class ReasoningNotRendered(ChatTemplateError):
    """The chat template drops the reply's reasoning, and the form the target wrote it in cannot be rebuilt."""


class InferenceUnavailable(DraftlineError):
    """The inference server cannot be reached or answers 5xx; worth retrying later."""

    permanent = False


class InferenceRejected(DraftlineError):
    """The inference server refused a request (4xx): the request itself is wrong."""


class HiddenStateFileError(DraftlineError):
    """A hidden-state file is missing, truncated, or disagrees with what the run expects."""


class HiddenStateScaleError(HiddenStateFileError):
    """An fp8 hidden-state file lacks a scale tensor, or one has the wrong shape or dtype or a value that is
    not finite and positive; or a file that is not fp8 carries one."""


class PathOutsideVolume(DraftlineError):
    """A path resolves outside the data volume."""


class RunNotFound(DraftlineError):
    """No run with that name exists on the volume."""


class RunExists(DraftlineError):
    """A run with that name already exists."""


class CheckpointFormatError(DraftlineError):
    """A drafter checkpoint lacks a key or a tensor has the wrong shape."""


class BaseCheckpointMismatch(CheckpointFormatError):
    """A base checkpoint does not fit the target it would be fine-tuned for; the message names each field
    that differs with both values."""


class RemoteCodeRefused(DraftlineError):
    """The target's tokenizer or model is code in its own directory, and running it is not allowed
    (``DRAFTLINE_TRUST_REMOTE_CODE``)."""


class UnsupportedRopeScaling(DraftlineError):
    """A config names a RoPE scaling type the drafter cannot reproduce the way the engines compute it."""


class MaskTokenUnavailable(DraftlineError):
    """A DFlash drafter needs a mask token id that the training data never holds, and none is free."""


class SpeculativeMismatch(DraftlineError):
    """A speculative decode emitted something other than the target's own greedy output: the decoding
    loop (or the target's numerics across block sizes) is wrong, so its acceptance lengths mean nothing."""


def error_class(exc: BaseException) -> str:
    """The name recorded for a failure: the exception's class name."""
    return type(exc).__name__


class ForeignJob(DraftlineError):
    """A queued job names a function that is not one of draftline's job functions for its queue."""


class TargetSourceMissing(DraftlineError):
    """The package that ships a target's weights is not installed (the message names the install command)."""


class TargetSourceMismatch(DraftlineError):
    """A target's source file is not the one draftline pins (another package version, or a modified file)."""


class TargetVerificationError(DraftlineError):
    """A converted target does not load as the model it was converted from."""


class TargetDirOccupied(DraftlineError):
    """A target's destination exists and is neither empty nor a target draftline made."""
