"""The MemAgent method as pure functions and state machines: no I/O, no engines, no Ray."""
