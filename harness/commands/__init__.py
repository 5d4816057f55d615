"""The commands of ``dcp-harness``, one module each (``bench`` a package of its subcommands).

Every command module has ``NAME``, ``HELP`` and ``DESCRIPTION`` (its subparser's name, one-line help and
description), ``add_arguments(parser)`` (its options) and ``run(args) -> int`` (its exit code);
``harness.cli`` registers them (``harness.commands.common.register``), calls the chosen one's ``run`` and
turns the typed errors into exit codes. A command imports what it runs at the top of its module, except
where that would import torch for every command (``dcp-harness --help`` and ``schedule`` never import it).
"""
