"""Tools around the library, not part of it: the timer-fidelity benchmark and the asv regression gate."""
