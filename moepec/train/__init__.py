"""The reference trainer (app layer): config, loop, steps, data, process groups, faults."""
