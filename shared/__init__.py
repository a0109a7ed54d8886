"""draftline's contracts: settings, storage layout, job payloads, run state, errors, metric names.

Every service imports from here; nothing here imports torch, so the controller, the generator and the
command line stay light.
"""

SCHEMA_VERSION = 1
