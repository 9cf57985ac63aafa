//! Unit tests of the emulator.
