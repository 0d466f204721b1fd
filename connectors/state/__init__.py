"""The state store: chain checkpoints, run membership and the serving job queue in one database."""
