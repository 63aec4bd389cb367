"""Pure checkpoint policy: which experts (selection), what was lost (PLT), who writes what (plan).

No I/O and no collectives: plain inputs in, plain results out.
"""
