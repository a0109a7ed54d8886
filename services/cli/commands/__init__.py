"""The ``draftline`` subcommands, one module each, named after its command (``make-target``: ``make_target.py``).

Each module has ``register(subparsers)``, which adds its command's parser and sets ``func`` to the handler;
``services/cli/main.py`` lists the modules, in the order ``draftline --help`` shows them. A module imports only
what its parser needs at the top and the rest inside its handler, so that every command, the containers'
health check included, starts without loading the code of the others.
"""
