"""The faults, one module per concern (what they hit: the database, the echo target, a worker).
Each module registers its `Fault` classes with `skiplock.chaos.nemesis.register`; the nemesis
imports every module here, so a new fault kind needs no list of modules to be kept."""
