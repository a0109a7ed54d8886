"""The ``draftline`` command line: service entrypoints, run submission, status, the demo."""
