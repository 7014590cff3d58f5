"""Exceptions ortrain raises to users."""


class OrtrainError(RuntimeError):
    """An error from ortrain: export, import, planning or execution. The message names the thing."""


class ExportError(OrtrainError):
    """The model could not be exported to ONNX by any exporter."""


class UnsupportedError(OrtrainError):
    """The exported graph has an op (or a feature) the engine cannot import, differentiate or run."""
