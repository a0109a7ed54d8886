"""draftline's services: one folder each, with a thin ``main.py`` entrypoint."""
