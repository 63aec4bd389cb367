"""The ``moepec`` command line (app layer): train, demo, inspect/verify/export, bench."""
