"""The command line: ``main`` runs the commands, ``parser`` parses, ``output`` prints,
``maintain`` and ``service`` hold their commands, ``demo`` is the main job."""
